"""One webhook POST within an overall deadline: connecting, TLS, sending and reading the answer's head.

httpx times each step apart (connect, each write, each read), so a receiver that answers one byte at a
time never trips a timeout and holds its sender for as long as it likes. Here every network step of
the request gets at most what is left of the attempt's deadline: httpcore (httpx's own core) runs the
request over a network backend that hands each step that remainder as its timeout.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import httpcore
import httpx

from portal.webhooks.destinations import Destination


class DeadlinePassed(httpcore.TimeoutException):
    """The attempt's overall deadline passed before the receiver's answer was read."""


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.ends = time.monotonic() + seconds

    def left(self, timeout: float | None) -> float:
        """The step's timeout: its own, or what is left of the deadline if that is shorter."""
        left = self.ends - time.monotonic()
        if left <= 0:
            raise DeadlinePassed("the attempt's deadline passed")
        return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, deadline: _Deadline) -> None:
        self._inner = inner
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._deadline.left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._deadline.left(timeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: object, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        tls = self._inner.start_tls(ssl_context, server_hostname, self._deadline.left(timeout))  # type: ignore[arg-type]
        return _DeadlineStream(tls, self._deadline)

    def get_extra_info(self, info: str) -> object:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, deadline: _Deadline) -> None:
        self._inner = httpcore.SyncBackend()
        self._deadline = deadline

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(host, port, self._deadline.left(timeout), local_address, socket_options)
        return _DeadlineStream(stream, self._deadline)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def post_status(
    destination: Destination,
    *,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    step_timeout_s: float,
    deadline_s: float,
) -> int:
    """POST `body` to the checked address and return the answer's status; the answer's body is not read.

    Raises `DeadlinePassed` past `deadline_s` in all, another `httpcore.TimeoutException` when one step
    takes longer than `step_timeout_s`, and httpcore's network and protocol errors."""
    deadline = _Deadline(deadline_s)
    step = {"connect": step_timeout_s, "read": step_timeout_s, "write": step_timeout_s, "pool": step_timeout_s}
    extensions: dict[str, object] = {"timeout": step}
    if destination.url.startswith("https:"):
        # The request goes to the checked address; TLS still names (and checks the certificate of) the host.
        extensions["sni_hostname"] = destination.server_name
    # No proxy: a proxy would resolve the name itself, past the check. No retries, no redirects.
    with (
        httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(), network_backend=_DeadlineBackend(deadline), max_connections=1
        ) as pool,
        pool.stream("POST", destination.url, headers=list(headers), content=body, extensions=extensions) as response,
    ):
        return response.status
