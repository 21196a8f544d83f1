"""A worker consuming several queues takes them in turn: a busy queue must not starve the others."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tasks.app import app
from tests.support.workers import start_worker, wait_until_consuming

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_queue_behind_a_long_backlog_is_still_served(tmp_path: Path) -> None:
    busy, quiet = "order-busy", "order-quiet"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    worker = start_worker("order", f"{busy},{quiet}", env=env, log_dir=tmp_path)
    try:
        wait_until_consuming([worker])
        backlog = [app.send_task("batchery.slot_info", args=(0.05,), queue=busy) for _ in range(40)]
        time.sleep(0.3)
        behind = app.send_task("batchery.slot_info", queue=quiet)
        assert behind.get(timeout=60)["queue"] == quiet
        served_before = sum(1 for result in backlog if result.ready())
        # Strict queue order (kombu's "priority" strategy) would serve all 40 first.
        assert served_before < 20, f"the quiet queue waited for {served_before} of the busy queue's 40 tasks"
    finally:
        worker.stop()
        with app.connection_for_write() as connection:
            for name in (busy, quiet):
                connection.SimpleQueue(name).clear()
