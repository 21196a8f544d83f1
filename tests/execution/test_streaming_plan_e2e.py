"""Streaming planning with real workers: a large job's first shards run while its input is still
being planned, and a job whose input turns out bad after shards ran ends `failed`, the bad lines
named, with nothing published."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from portal.catalog.models import Model
from portal.catalog.services import catalog_publish
from portal.jobs.models import Job, JobEvent, JobStatus, Shard, ShardStatus
from tasks.shared.storage import store_for
from tests.execution.conftest import ended, report, ts
from tests.factories import ModelFactory
from tests.support.chaos import ChaosStack, check_exactly_once, wait_for, write_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RECORDS = 200_000
SHARD_SIZE = 5_000


@pytest.fixture
def quick_echo(sim: ChaosStack) -> str:
    """The echo model without its sleep: the shards cost little beside planning 200,000 records."""
    ModelFactory(
        name="quick-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.CLASSIFY,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"time_limit_base_s": 60, "time_limit_per_record_s": 0.01},
        is_default=False,
    )
    # Published now, not by the reconciler's next sweep: that waits behind the planner on the control worker.
    catalog_publish()
    return "quick-echo"


def _event_at(job: Job, status: str) -> float:
    return ts(JobEvent.objects.filter(job=job, status=status).order_by("at").first().at)  # type: ignore[union-attr]


def test_a_large_jobs_first_shard_starts_before_its_planning_ends(
    sim: ChaosStack, tmp_path: Path, quick_echo: str
) -> None:
    path = tmp_path / "large.jsonl"
    ids = write_records(path, [f"sentence number {n}" for n in range(RECORDS)])
    job = ended(sim.submit(model=quick_echo, input_path=path, shard_size=SHARD_SIZE, tenant="streaming"), sim)

    planning_started = _event_at(job, JobStatus.PLANNING)
    planning_ended = _event_at(job, JobStatus.RUNNING)
    started = [ts(s.started_at) for s in job.shards.all() if s.started_at]
    first_started = min(started)
    report(
        f"streaming planning: {RECORDS:,} records, {job.shard_count} shards",
        [
            ("submission to first shard started", f"{first_started - ts(job.created_at):.2f} s"),
            ("planning (planning to running)", f"{planning_ended - planning_started:.2f} s"),
            ("shards started before planning ended", f"{sum(1 for t in started if t < planning_ended)}"),
        ],
    )
    assert first_started < planning_ended
    assert job.status == JobStatus.SUCCEEDED
    check_exactly_once("streaming planning", job, ids, 0)


def test_a_job_whose_bad_lines_come_after_shards_ran_fails_naming_them_and_publishes_nothing(
    sim: ChaosStack, tmp_path: Path, quick_echo: str
) -> None:
    path = tmp_path / "bad-at-the-end.jsonl"
    write_records(path, [f"sentence number {n}" for n in range(RECORDS)])
    with path.open("ab") as handle:
        handle.write(b"not json\n")
        handle.write(orjson.dumps({"custom_id": "rec-000000", "input": "the first id again"}) + b"\n")
    # A first job warms every slot on the model, so that this one's shards start as soon as they are sent.
    warm = tmp_path / "warm.jsonl"
    write_records(warm, [f"warm {n}" for n in range(SHARD_SIZE * 8)])
    ended(sim.submit(model=quick_echo, input_path=warm, shard_size=SHARD_SIZE, tenant="streaming"), sim)
    sim.env["BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES"] = "0"  # the planner, not the submission, checks it

    job = ended(sim.submit(model=quick_echo, input_path=path, shard_size=SHARD_SIZE, tenant="streaming"), sim)

    assert job.status == JobStatus.FAILED
    assert job.error.startswith(f"input rejected: 2 bad lines: line {RECORDS + 1}: not valid JSON")
    assert f"line {RECORDS + 2}: duplicate custom_id 'rec-000000' (first on line 1)" in job.error
    failed_at = _event_at(job, JobStatus.FAILED)

    def ran_before_the_failure() -> list[Shard]:
        done = Shard.objects.filter(job=job, status=ShardStatus.SUCCEEDED, started_at__isnull=False)
        return [s for s in done if ts(s.started_at) < failed_at]  # type: ignore[arg-type]

    # Their callbacks wait for the control worker, which was planning: they settle after the failure.
    ran: Any = wait_for(ran_before_the_failure, timeout_s=60, what="a shard that ran before the failure", stack=sim)
    assert ran
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    for uri in (job.output_uri, job.errors_uri):
        assert not store_for(uri).exists(uri)
