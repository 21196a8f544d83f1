"""Webhook test helpers: real HTTP receivers on 127.0.0.1 that record what they get and answer with
the status codes a test scripts; endpoints allowed to reach them; tiny retry delays."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from portal.tenancy.models import Membership, Tenant
from portal.webhooks.models import WebhookEndpoint
from portal.webhooks.services.endpoints import webhook_endpoint_create
from tasks.shared.redis_client import redis_client
from tests.api.conftest import Caller, make_caller
from tests.factories import TenantFactory


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    """An HTTP server in a thread: answers each POST with the next scripted status (then 200)."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = list(answers)
        self.received: list[Received] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    status = receiver.answers.pop(0) if receiver.answers else 200
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", f"http://127.0.0.1:{receiver.port}/elsewhere")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:  # keep the test output quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def requests(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def wait_for(self, count: int, *, timeout_s: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.requests()) >= count:
                return self.requests()
            time.sleep(0.05)
        raise AssertionError(f"the receiver got {len(self.requests())} requests, not {count}, in {timeout_s} s")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class TrickleReceiver:
    """A hostile receiver on 127.0.0.1: reads the request, then answers one byte a second (a whole answer
    would take about a minute). Counts the connections it got and the ones its sender has dropped."""

    ANSWER = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Padding: " + b"." * 40 + b"\r\nContent-Length: 2\r\n\r\nok"
    )

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.connections = 0
        self.dropped: list[float] = []
        """How long each connection lasted until its sender dropped it, in seconds."""
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            thread = threading.Thread(target=self._trickle, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _trickle(self, conn: socket.socket) -> None:
        started = time.monotonic()
        with conn:
            conn.settimeout(5)
            request = b""
            try:
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536) or b"\r\n\r\n"
                for byte in self.ANSWER:
                    if self._stop.wait(1.0):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                with self._lock:
                    self.dropped.append(time.monotonic() - started)

    def wait_for_connections(self, count: int, *, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.connections < count:
            time.sleep(0.05)
        assert self.connections >= count, f"the trickling receiver got {self.connections} connections, not {count}"

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.fixture(autouse=True)
def no_places_left_over() -> Iterator[None]:
    """Each test starts with no tenant's webhook places taken or deliveries waiting (`in_flight`): a test
    database made anew gives its tenants the ids of an earlier run's."""

    def clear() -> None:
        client = redis_client()
        for key in client.scan_iter(match="batchery:webhooks:*"):
            client.delete(key)

    clear()
    yield
    clear()


@pytest.fixture
def trickle() -> Iterator[Callable[[], TrickleReceiver]]:
    """Start trickling receivers; all are stopped after the test."""
    started: list[TrickleReceiver] = []

    def start() -> TrickleReceiver:
        server = TrickleReceiver()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    """Start receivers answering with the given status codes; all are stopped after the test."""
    started: list[Receiver] = []

    def start(*answers: int) -> Receiver:
        server = Receiver(list(answers))
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def webhook_settings(settings: Any) -> Any:
    """127.0.0.1 allowed explicitly; retries after 50 and 100 ms (three attempts in all)."""
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    settings.BATCHERY_WEBHOOK_RETRY_DELAYS_S = (0.05, 0.1)
    settings.BATCHERY_WEBHOOK_TIMEOUT_S = 5.0
    return settings


def endpoint_for(tenant: Tenant, url: str, *event_types: str) -> WebhookEndpoint:
    return webhook_endpoint_create(tenant=tenant, url=url, event_types=list(event_types) or None)


@pytest.fixture
def caller(db: None) -> Callable[..., Caller]:
    """An API caller: a user with a role in a tenant (created by name) and a key for them."""

    def make(tenant: str, role: str = Membership.Role.ADMIN) -> Caller:
        return make_caller(TenantFactory(name=tenant), role)

    return make
