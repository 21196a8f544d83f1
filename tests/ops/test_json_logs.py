"""BATCHERY_LOG_FORMAT=json end to end: the portal, a control worker, the planning worker and a launcher
with its slot worker write nothing but JSON lines, and the lines of one job carry its id (and shard) on
both sides."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from portal.jobs.models import Job
from tasks.shared.logging_setup import received_log_fields, task_log_fields
from tests.factories import ModelFactory
from tests.ops.conftest import Launcher, wait_slots
from tests.support.chaos import ChaosStack, wait_for, write_records
from tests.support.workers import REPO

RECORDS = 60
SHARD_SIZE = 20


@pytest.fixture
def stack_env() -> dict[str, str]:
    """Every process of the stack (control and planning workers, launcher, slot workers, `manage.py submit`)
    logs JSON."""
    return {"BATCHERY_LOG_FORMAT": "json"}


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every non-empty line of the log, each of which must be a JSON object with a level and a message."""
    parsed = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            raise AssertionError(f"{path.name}:{number} is not JSON: {line!r}") from None
        assert isinstance(value, dict) and {"level", "message"} <= set(value), f"{path.name}:{number}: {line!r}"
        parsed.append(value)
    return parsed


def celery_lines(lines: list[dict[str, Any]], task: str, logger: str) -> list[dict[str, Any]]:
    """Celery's own lines about `task`: the worker's "received" (`celery.worker.strategy`) or the
    pool's "succeeded" (`celery.app.trace`); Celery puts the task's name in the record's `data`."""
    return [line for line in lines if line["logger"] == logger and (line.get("data") or {}).get("name") == task]


def test_a_tasks_job_is_read_from_its_arguments() -> None:
    spec = {"job_id": "j-1", "shard_index": 7, "record_count": 20}
    assert task_log_fields("batchery.run_shard", [spec], {}) == {"job_id": "j-1", "shard": 7}
    assert task_log_fields("batchery.run_shard", [], {"spec": spec}) == {"job_id": "j-1", "shard": 7}
    assert task_log_fields("batchery.merge_job", ["j-1"], {"stop": "cancelled"}) == {"job_id": "j-1"}
    assert task_log_fields("batchery.plan_job", [], {"job_id": "j-1"}) == {"job_id": "j-1"}
    assert task_log_fields("batchery.finalize_batch", ["b-1"], {}) == {"batch_id": "b-1"}
    assert task_log_fields("batchery.reconcile", [], {}) == {}


def test_a_received_tasks_job_is_read_from_its_printed_arguments_even_when_celery_cut_them() -> None:
    spec = repr(({"job_id": "j-1", "shard_index": 7, "model": {"source": "x" * 2000}},))[:1024] + "..."
    assert received_log_fields("batchery.run_shard", spec, "{}") == {"job_id": "j-1", "shard": 7}
    assert received_log_fields("batchery.merge_job", "['j-1']", "{'stop': 'cancelled'}") == {"job_id": "j-1"}
    assert received_log_fields("batchery.plan_job", "('j-1',)", "{}") == {"job_id": "j-1"}
    assert received_log_fields("batchery.plan_job", "()", "{'job_id': 'j-1'}") == {"job_id": "j-1"}
    assert received_log_fields("batchery.finalize_batch", "('b-1',)", "{}") == {"batch_id": "b-1"}
    assert received_log_fields("batchery.reconcile", "()", "{}") == {}


def test_the_portals_records_warnings_and_djangos_own_are_json_lines_written_once() -> None:
    script = (
        "import django, logging, warnings; django.setup(); "
        "logging.getLogger('django.request').warning('Not Found: /nowhere'); "
        "warnings.warn('an old setting', UserWarning)"
    )
    env = {**os.environ, "BATCHERY_LOG_FORMAT": "json", "DEBUG": "1", "DJANGO_SETTINGS_MODULE": "portal.settings"}
    finished = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True
    )
    lines = [json.loads(line) for line in finished.stderr.splitlines() if line.strip()]
    assert [line["logger"] for line in lines if "nowhere" in line["message"]] == ["django.request"]
    assert any(line["logger"] == "py.warnings" and "an old setting" in line["message"] for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_job_is_followed_by_its_id_through_json_lines_of_the_control_worker_and_a_slot(
    stack: ChaosStack, tmp_path: Path
) -> None:
    ModelFactory(
        name="json-echo", engine="python", task="classify", is_default=False,
        source="tests.support.chaos_engines:echo_factory", default_params={"time_limit_base_s": 10},
    )  # fmt: skip
    launcher = Launcher(stack, "cpu", "--cpu-slots", "1")
    try:
        wait_slots(stack, 1)
        write_records(tmp_path / "in.jsonl", [f"record {n}" for n in range(RECORDS)])
        job_id = stack.submit(model="json-echo", input_path=tmp_path / "in.jsonl", shard_size=SHARD_SIZE)
        job = wait_for(
            lambda: (j := Job.objects.get(pk=job_id)).is_finished and j, timeout_s=90, what="the job", stack=stack
        )
        assert job.status == "succeeded"
        # Stopped the way an operator stops them, so their shutdown lines are checked too.
        launcher.process.send_signal(signal.SIGTERM)
        assert launcher.process.wait(timeout=60) == 0
    finally:
        launcher.stop()
    stack.workers["control"].stop()
    stack.workers["planning"].stop()

    host_lines = json_lines(launcher.log_path)
    control_lines = json_lines(stack.workers["control"].log_path)
    planning_lines = json_lines(stack.workers["planning"].log_path)

    shards = range(RECORDS // SHARD_SIZE)
    for shard in shards:
        of_shard = [line for line in host_lines if line.get("shard") == shard]
        assert of_shard, f"no line of the slot worker names shard {shard}"
        assert {line["job_id"] for line in of_shard} == {job_id}
        assert {line["slot"] for line in of_shard} == {"0"}
    for logger in ("celery.worker.strategy", "celery.app.trace"):
        lines = celery_lines(host_lines, "batchery.run_shard", logger)
        assert sorted(line["shard"] for line in lines) == list(shards), logger
        assert {line["job_id"] for line in lines} == {job_id}, logger
        assert all(line["host"] for line in lines)

    # Planning runs on its own lane's worker.
    for logger in ("celery.worker.strategy", "celery.app.trace"):
        lines = celery_lines(planning_lines, "batchery.plan_job", logger)
        assert lines, f"no {logger} line of batchery.plan_job"
        assert {line["job_id"] for line in lines} == {job_id}, logger
    # A job this small merges in the callback that settled its last shard (BATCHERY_INLINE_MERGE_MAX_RECORDS).
    merged = [line for line in control_lines if line["logger"] == "portal.execution.merge"]
    assert any(f"job {job_id} succeeded" in line["message"] for line in merged), "no line of the job's merge"
    assert {line.get("job_id") for line in merged} == {job_id}
