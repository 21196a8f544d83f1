"""The systemd example's Redis, run for real: `deploy/systemd/redis.conf.example` (TLS only, a password)
with a throwaway CA, reached with the broker URLs of `gpuworkers.env.example` by the broker, the result
backend and the progress client, as a GPU host reaches it; without the password or without TLS, refused."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from portal.devstack.embedded import free_port
from tests.deploy.deployment_files import DEPLOY, PLACEHOLDER, env_file

SYSTEMD = DEPLOY / "systemd"
PASSWORD = "a-password-for-this-test"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _tls_files(directory: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=batchery-test-ca", cwd=directory)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "redis.key", "-out", "redis.csr",
             "-subj", "/CN=127.0.0.1", cwd=directory)  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "redis.crt", "-days", "1", "-extfile", "san.cnf", cwd=directory)  # fmt: skip


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """redis-server with the example's settings; the port, the certificates' paths and the password filled in."""
    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("redis-server and openssl are needed on PATH")
    _tls_files(tmp_path)
    port = free_port()
    config = (SYSTEMD / "redis.conf.example").read_text()
    config = config.replace("tls-port 6380", f"tls-port {port}").replace(
        "/etc/redis/tls/ca.crt", str(tmp_path / "ca.crt")
    )
    config = config.replace("/etc/redis/tls/", f"{tmp_path}/").replace(
        f"requirepass {PLACEHOLDER}", f"requirepass {PASSWORD}"
    )
    config += f"bind 127.0.0.1\ndir {tmp_path}\n"
    (tmp_path / "redis.conf").write_text(config)
    log = (tmp_path / "redis.log").open("wb")
    server = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf")], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        deadline = time.monotonic() + 20
        while b"Ready to accept connections" not in (tmp_path / "redis.log").read_bytes():
            if server.poll() is not None:
                pytest.skip(
                    f"this redis-server cannot run the example (no TLS?): {(tmp_path / 'redis.log').read_text()[-500:]}"
                )
            assert time.monotonic() < deadline, (tmp_path / "redis.log").read_text()
            time.sleep(0.1)
        yield port, tmp_path / "ca.crt"
    finally:
        server.terminate()
        server.wait(timeout=20)


def _example_url(variable: str, port: int, ca: Path) -> str:
    """The example's URL pointed at this server: its host, port, password and CA file replaced, the rest kept."""
    url = env_file(SYSTEMD / "gpuworkers.env.example")[variable]
    return (
        url.replace("redis.internal:6380", f"127.0.0.1:{port}")
        .replace(PLACEHOLDER, PASSWORD)
        .replace("/etc/batchery/tls/redis-ca.crt", str(ca))
    )


def test_the_examples_broker_urls_reach_the_tls_redis_and_nothing_else_does(
    tls_redis: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, ca = tls_redis
    broker, backend = (_example_url(name, port, ca) for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"))
    monkeypatch.setenv("CELERY_BROKER_URL", broker)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", backend)
    monkeypatch.delenv("BATCHERY_PROGRESS_REDIS_URL", raising=False)
    from celery import Celery

    from tasks.shared.broker_transport import register_broker_transport
    from tasks.shared.redis_client import redis_client

    register_broker_transport()
    app = Celery("tls-probe", broker=broker, backend=backend)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue("batchery-tls-probe")
        queue.put({"probe": 1})
        message = queue.get(timeout=10)
        message.ack()
        assert message.payload == {"probe": 1}
        queue.close()
    app.backend.set("batchery-tls-probe", b"stored")
    assert app.backend.get("batchery-tls-probe") == b"stored"
    assert redis_client().ping()
    # A wrong password, and plain text on the TLS port, get nowhere.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(broker.replace(PASSWORD, "wrong"), socket_timeout=5).ping()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", socket_timeout=5).ping()
