"""A TCP proxy on 127.0.0.1 that a test can take down and bring back: a network outage on demand.

Stopping moto's server would lose its in-memory buckets; putting this proxy between the workers and
the server gives them the same experience (connections refused, open ones reset) while the data
survives the outage.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

from portal.devstack.embedded import free_port

CHUNK = 64 * 1024


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.refused = 0
        """Connections refused or reset while the proxy was down."""
        self._up = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, name="tcp-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._up.set()
        self._thread.start()
        return self

    def down(self) -> None:
        """New connections are reset at once and open ones are cut."""
        self._up.clear()
        with self._lock:
            for sock in list(self._open):
                _reset(sock)
                self.refused += 1
            self._open.clear()

    def up(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._stopped.set()
        self.down()
        self._thread.join(timeout=5)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._up.is_set():
                _reset(client)
                self.refused += 1
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(CHUNK):
                target.sendall(chunk)
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)
        with self._lock:
            self._open.discard(source)


def _reset(sock: socket.socket) -> None:
    """Close with RST, as a crashed server's host would answer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # A pipe thread blocked in recv holds the socket open past close(), so no RST would go out and the
        # peer would wait for its read timeout: shutting the reading side first wakes that thread.
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


@contextlib.contextmanager
def tcp_proxy(target_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_port).start()
    try:
        yield proxy
    finally:
        proxy.close()
