"""`manage.py up` with nothing configured: the whole stack comes up on 127.0.0.1 and stops cleanly."""

from __future__ import annotations

import re
import time
import urllib.request

import psutil
import pytest
from celery import Celery

from portal.devstack.stack import StackOptions
from tests.ops.conftest import UpProcess, stop_process_group

pytestmark = pytest.mark.slow

# Planning, webhook deliveries and batch validations have workers of their own, off the control lane.
WORKERS = {"control", "planning", "webhooks", "validation", "slot0-cpu"}


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as response:
        status: int = response.status
        return status


def _portal_workers(up: UpProcess, timeout_s: float = 30) -> int:
    """The gunicorn workers under the portal's master, given up to `timeout_s` to start them all."""
    (master,) = [
        child for child in psutil.Process(up.process.pid).children() if "gunicorn" in " ".join(child.cmdline())
    ]
    deadline = time.monotonic() + timeout_s
    while len(master.children()) < StackOptions.portal_workers and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(master.children())


def test_up_starts_portal_flower_control_planning_webhooks_validation_and_slot_workers_then_stops_on_sigterm(
    up_without_services: UpProcess,
) -> None:
    up = up_without_services
    broker = None
    deadline = time.monotonic() + 120
    answered: set[str] = set()
    while time.monotonic() < deadline:
        assert up.process.poll() is None, up.log_tail()
        match = re.search(r"broker (redis://\S+?)\. Ctrl-C", up.log_path.read_text())
        if match and broker is None:
            broker = match.group(1)
        if broker:
            try:
                assert _get(f"http://127.0.0.1:{up.portal_port}/healthz") == 200
                assert _get(f"http://127.0.0.1:{up.flower_port}/healthcheck") == 200
            except OSError:
                time.sleep(0.5)
                continue
            # Celery lets CELERY_BROKER_URL override a URL given in code; this run's points elsewhere.
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("CELERY_BROKER_URL", broker)
                patch.setenv("CELERY_RESULT_BACKEND", broker)
                replies = Celery(broker=broker, backend=broker).control.ping(timeout=1.0) or []
            answered = {name.split("@")[0] for reply in replies for name in reply}
            if answered >= WORKERS:
                break
        time.sleep(0.5)
    assert answered >= WORKERS, up.log_tail()
    assert (up.var_dir / "batchery.sqlite3").exists()
    assert _portal_workers(up) == StackOptions.portal_workers, "the portal runs as many workers as deployments do"
    stop_process_group(up.process, timeout_s=60)
    assert up.process.returncode == 0, up.log_tail()
