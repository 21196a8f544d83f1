"""Pause and resume with real workers: nothing starts while paused, not even across a Redis restart,
and the output is byte for byte that of a run never paused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from portal.jobs.models import Job, JobStatus
from tests.execution.conftest import ended, report, submit, wait_status
from tests.support.chaos import ChaosStack, check_exactly_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _attempt_starts(job: Job) -> list[float]:
    return [
        marker.stat().st_mtime
        for shard in job.shards.all()
        for marker in (Path(shard.prefix_uri.removeprefix("file://")) / "started").glob("*")
    ]


def test_a_paused_job_starts_nothing_even_after_a_redis_restart_and_resumes_to_the_same_output(
    sim: ChaosStack, tmp_path: Path
) -> None:
    job_id, ids, _ = submit(sim, tmp_path, "pausing", 60_000)
    wait_status(job_id, {JobStatus.RUNNING}, 60, sim)
    time.sleep(3)
    sim.manage("job", "pause", job_id)
    paused_at = time.time()
    time.sleep(3)
    sim.restart_redis_empty()  # the pause flags and the queued shards are gone; PostgreSQL keeps the pause
    time.sleep(10)
    still_paused = Job.objects.get(pk=job_id).status
    resumed_at = time.time()  # before the command: the resume takes effect while it runs
    sim.manage("job", "resume", job_id)
    job = ended(job_id, sim)
    check_exactly_once("paused, Redis restarted, resumed", job, ids, 0)

    # Shards already running when the pause came finish; one fetched a moment before may start.
    started_while_paused = [t for t in _attempt_starts(job) if paused_at + 0.5 < t < resumed_at]
    events = list(job.events.values_list("status", flat=True))
    reference_id, reference_ids, _ = submit(sim, tmp_path, "reference", 60_000)
    reference = ended(reference_id, sim)
    check_exactly_once("never paused", reference, reference_ids, 0)
    same_output = (
        Path(job.output_uri.removeprefix("file://")).read_bytes()
        == Path(reference.output_uri.removeprefix("file://")).read_bytes()
    )
    report(
        "pause 3 s into a 60,000-record job, Redis restarted empty while paused, resume 13 s later",
        [
            ("status 10 s after the Redis restart", still_paused),
            ("shard attempts started while paused", str(len(started_while_paused))),
            ("job events", " → ".join(events)),
            ("output identical to a run never paused", str(same_output)),
        ],
    )
    assert still_paused == JobStatus.PAUSED
    assert started_while_paused == [], (paused_at, resumed_at, sorted(_attempt_starts(job)))
    assert events == ["queued", "planning", "running", "paused", "running", "merging", "succeeded"]
    assert same_output
