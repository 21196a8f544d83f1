"""`manage.py up` with nothing configured: the whole stack comes up on 127.0.0.1 and stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from celery import Celery

from portal.ops.embedded import free_port

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as response:
        status: int = response.status
        return status


def test_up_starts_portal_flower_control_and_slot_workers_then_stops_on_sigterm(tmp_path: Path) -> None:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "DATABASE_URL", "BATCHERY_STORAGE_URL"}
    }
    env["BATCHERY_VAR_DIR"] = str(tmp_path / "var")
    portal_port, flower_port = free_port(), free_port()
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        up = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--address", f"127.0.0.1:{portal_port}",
             "--flower-port", str(flower_port), "--cpu-slots", "1", "--loglevel", "WARNING"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        broker = None
        deadline = time.monotonic() + 120
        answered: set[str] = set()
        while time.monotonic() < deadline:
            assert up.poll() is None, log_path.read_text()[-3000:]
            text = log_path.read_text()
            match = re.search(r"broker (redis://\S+?)\. Ctrl-C", text)
            if match and broker is None:
                broker = match.group(1)
            if broker:
                try:
                    assert _get(f"http://127.0.0.1:{portal_port}/healthz") == 200
                    assert _get(f"http://127.0.0.1:{flower_port}/healthcheck") == 200
                except OSError:
                    time.sleep(0.5)
                    continue
                # Celery lets CELERY_BROKER_URL override a URL given in code; this run's points elsewhere.
                with pytest.MonkeyPatch.context() as patch:
                    patch.setenv("CELERY_BROKER_URL", broker)
                    patch.setenv("CELERY_RESULT_BACKEND", broker)
                    replies = Celery(broker=broker, backend=broker).control.ping(timeout=1.0) or []
                answered = {name.split("@")[0] for reply in replies for name in reply}
                if {"control", "slot0-cpu"} <= answered:
                    break
            time.sleep(0.5)
        assert {"control", "slot0-cpu"} <= answered, log_path.read_text()[-3000:]
        assert (tmp_path / "var" / "batchery.sqlite3").exists()
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert up.returncode == 0, log_path.read_text()[-3000:]
