"""Celery task events, which only Flower reads: off in a worker until a monitor asks for them, as Flower
does every 5 s (`enable_events`), and on from the start with `BATCHERY_TASK_EVENTS`."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.app import app
from tests.support.workers import WorkerProcess, start_worker, wait_until_consuming

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
QUEUE = "test.task-events"


class EventLog:
    """Every event published on the broker while it runs, gathered by a real receiver on a thread."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._receiver: Any = None

    def _receive(self) -> None:
        with app.connection_for_read() as connection:
            self._receiver = receiver = app.events.Receiver(connection, handlers={"*": self.events.append})
            turns = 0

            def turned() -> None:
                nonlocal turns
                turns += 1
                # The first turn of the loop subscribes to the broker's fanout: an event published before is missed.
                if turns > 1:
                    self._subscribed.set()

            receiver.on_iteration = turned  # type: ignore[method-assign]
            receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> EventLog:
        self._thread.start()
        assert self._subscribed.wait(10), "the event receiver did not start"
        return self

    def __exit__(self, *_: object) -> None:
        self._receiver.should_stop = True
        self._thread.join(10)

    def of_task(self, task_id: str) -> set[str]:
        return {event["type"] for event in self.events if event.get("uuid") == task_id}


def _worker(name: str, **extra_env: str) -> Iterator[WorkerProcess]:
    env = {name: value for name, value in os.environ.items() if name != "BATCHERY_TASK_EVENTS"}
    worker = start_worker(name, QUEUE, env={**env, **extra_env}, log_dir=ARTIFACTS / "logs", heartbeat=True)
    try:
        wait_until_consuming([worker])
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def quiet_worker() -> Iterator[WorkerProcess]:
    yield from _worker("events-off")


@pytest.fixture
def eventful_worker() -> Iterator[WorkerProcess]:
    yield from _worker("events-on", BATCHERY_TASK_EVENTS="true")


def _run_task(worker: WorkerProcess) -> str:
    result = app.send_task("batchery.slot_info", queue=QUEUE)
    assert result.get(timeout=30)["hostname"] == worker.hostname
    return result.id


def _wait_for(log: EventLog, task_id: str, wanted: set[str], timeout_s: float = 10) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while not wanted <= log.of_task(task_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    return log.of_task(task_id)


def test_a_worker_sends_no_task_event_until_a_monitor_turns_events_on(quiet_worker: WorkerProcess) -> None:
    with EventLog() as log:
        unwatched = _run_task(quiet_worker)
        time.sleep(1)  # any event of the task would be on the wire by now
        assert log.of_task(unwatched) == set(), [e for e in log.events if e.get("uuid") == unwatched]

        # What Flower does on its start and every 5 s after.
        replies = app.control.enable_events(destination=[quiet_worker.hostname], reply=True, timeout=5)
        assert replies, f"the worker did not answer enable_events:\n{quiet_worker.log_tail()}"
        watched = _run_task(quiet_worker)
        seen = _wait_for(log, watched, {"task-received", "task-started", "task-succeeded"})
        assert {"task-received", "task-started", "task-succeeded"} <= seen


def test_batchery_task_events_turns_them_on_from_the_start(eventful_worker: WorkerProcess) -> None:
    with EventLog() as log:
        task_id = _run_task(eventful_worker)
        seen = _wait_for(log, task_id, {"task-received", "task-started", "task-succeeded"})
        assert {"task-received", "task-started", "task-succeeded"} <= seen
