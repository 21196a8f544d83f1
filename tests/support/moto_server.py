"""A real `moto_server` process (an S3 look-alike) on 127.0.0.1, for tests of the s3:// backend.

A separate process rather than moto's in-process mocks, so the store's real HTTP client, retries,
timeouts and streaming are what the tests exercise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from portal.devstack.embedded import free_port

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/moto-api/data.json", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running_moto_server(start_timeout_s: float = 20.0, *, host: str = "127.0.0.1") -> Iterator[str]:
    """Start moto_server on a free port of `host`, yield its endpoint URL, and always stop it."""
    port = free_port()
    url = f"http://{host}:{port}"
    log_dir = ARTIFACTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"moto-server-{port}.log"
    # moto_server is installed beside the interpreter; its log goes to a file, not a pipe that
    # could fill up and stall the server mid-test.
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", host, "-p", str(port)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not _answers(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"moto_server did not start on {url} (exit {process.poll()}):\n{tail}")
                time.sleep(0.1)
            yield url
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
