"""The S3 clients of a process (weights here, shard data in `tasks.shared.storage.s3`), configured in one
place, and which of their failures a retry may fix.

Standard retries (``BATCHERY_S3_MAX_ATTEMPTS``), fixed timeouts, the endpoint and credentials from
boto3's own environment (``AWS_ENDPOINT_URL``, ``AWS_*``). It lives here, not in `tasks`, because
`gpuworkers` imports nothing of `tasks` while `tasks` may import `gpuworkers`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.settings import s3_max_attempts
from gpuworkers.weights import WeightsUnavailableError

_CONNECT_TIMEOUT_S = 10
_READ_TIMEOUT_S = 60
_PERMANENT_CODES = {"NoSuchBucket", "NoSuchKey", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


class S3Clients:
    """One client per process, made on first use and shared by threads (boto3 clients are
    thread-safe; sessions are not, hence the lock). A forked child (a Celery pool process) must not
    reuse its parent's pooled connections, so the pid is part of the key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: tuple[int, Any] | None = None

    def get(self) -> Any:
        cached = self._cached
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        with self._lock:
            if self._cached is None or self._cached[0] != os.getpid():
                self._cached = (os.getpid(), new_s3_client())
            return self._cached[1]


_clients = S3Clients()


def s3_client() -> Any:
    """The client this process reads weights with."""
    return _clients.get()


def new_s3_client() -> Any:
    # Imported here: boto3 adds ~0.2 s to the start of a process that never touches s3://.
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "total_max_attempts": s3_max_attempts()},
        connect_timeout=_CONNECT_TIMEOUT_S,
        read_timeout=_READ_TIMEOUT_S,
        signature_version="s3v4",
    )
    # No endpoint_url argument: boto3 then reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL itself.
    return boto3.session.Session().client("s3", config=config)


def weights_error(exc: BaseException, source: str, action: str) -> Exception:
    """EngineLoadError when retrying cannot help (no bucket, no access), else WeightsUnavailableError."""
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _PERMANENT_CODES or status in (403, 404):
            return EngineLoadError(f"model source {source!r}: S3 {code or status} while {action}")
    elif isinstance(exc, BotoCoreError) and "Credentials" in type(exc).__name__:
        return EngineLoadError(f"model source {source!r}: {exc} while {action}")
    return WeightsUnavailableError(f"model source {source!r}: {type(exc).__name__} while {action}: {exc}")
