"""Fixtures of the chaos suite: a killable stack per test, the test models, and the report table.

`make chaos` runs the suite at full size (CHAOS_SCALE=full) and prints the table; `make test`
runs it at a smaller size. Each stack runs `CHAOS_CONTROL_WORKERS` control processes (2 unless set).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from portal.catalog.models import Model
from tests.factories import ModelFactory
from tests.support.chaos import CHAOS_ENV, CONTROL_WORKERS, ChaosResult, ChaosStack
from tests.support.workers import database_url

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
FULL = os.environ.get("CHAOS_SCALE") == "full"
RESULTS: list[ChaosResult] = []


def scale(small: int, full: int) -> int:
    return full if FULL else small


@pytest.fixture
def chaos_stack(transactional_db: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ChaosStack]:
    from django.db import connection

    env = {**os.environ, **CHAOS_ENV}
    env["DATABASE_URL"] = database_url(connection.settings_dict)
    env["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    stack = ChaosStack(
        env=env,
        data_dir=tmp_path / "chaos",
        log_dir=ARTIFACTS / "chaos-logs" / request.node.name,
        control_workers=CONTROL_WORKERS,
    )
    stack.start_redis()
    try:
        stack.start_control()
        stack.start_shard_worker()
        wait_consuming(stack)
        yield stack
    finally:
        stack.stop()


def wait_consuming(stack: ChaosStack, timeout_s: float = 60) -> None:
    from celery import Celery

    expected = {worker.hostname for worker in stack.workers.values()}
    deadline = time.monotonic() + timeout_s
    with pytest.MonkeyPatch.context() as patch:
        # Celery prefers these variables over a URL given in code; point them at this stack's Redis.
        patch.setenv("CELERY_BROKER_URL", stack.broker_url)
        patch.setenv("CELERY_RESULT_BACKEND", stack.broker_url)
        probe = Celery(broker=stack.broker_url, backend=stack.broker_url)
        while time.monotonic() < deadline:
            for worker in stack.workers.values():
                if worker.process.poll() is not None:
                    raise RuntimeError(f"worker {worker.name} exited early:\n{worker.log_tail()}")
            try:
                answered = {name for reply in probe.control.ping(timeout=1.0) or [] for name in reply}
            except redis.ConnectionError:
                # The broker, started a moment ago, dropped the probe's connection (seen under load):
                # ask again until the deadline.
                time.sleep(0.2)
                continue
            if expected <= answered:
                return
    raise TimeoutError(f"chaos workers did not answer within {timeout_s}s:\n{stack.logs()}")


@pytest.fixture
def chaos_model(transactional_db: None) -> Any:
    """Make a catalog entry for one of the chaos engines in `tests.support.chaos_engines`."""

    def make(factory: str, load_params: dict[str, Any] | None = None, **params: Any) -> Model:
        return ModelFactory(
            name=f"chaos-{factory}",
            engine=Model.Engine.PYTHON,
            task=Model.Task.CLASSIFY,
            source=f"tests.support.chaos_engines:{factory}_factory",
            default_params={"time_limit_base_s": 8, "time_limit_per_record_s": 0.05, **params},
            load_params=load_params or {},
            is_default=False,
        )

    return make


@pytest.fixture
def chaos_report() -> Any:
    return RESULTS.append


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    header = ["scenario", "records in", "out", "errors", "duplicates", "lost", "seconds", "status", "error codes"]
    rows = [
        [r.scenario, r.records_in, r.out, r.errors, r.duplicates, r.lost, r.seconds, r.status, r.error_codes]
        for r in RESULTS
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    table = "\n".join(lines)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "chaos.md").write_text(table + "\n")
    terminalreporter.write_sep("=", "chaos")
    terminalreporter.write_line(table)
