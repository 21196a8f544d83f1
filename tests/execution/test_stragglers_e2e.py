"""Stragglers with real workers: one slot five times slower; its last shard runs again on an idle slot."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from portal.jobs.models import Job, ShardStatus
from tests.chaos.conftest import wait_consuming
from tests.execution.conftest import SLOTS, ended, report, submit, ts
from tests.support.chaos import ChaosStack, check_exactly_once, wait_for

SHARDS = 40
SLOW = f"slot{SLOTS - 1}"
# The slow slot joins the queue when this many shards have committed, so that its shard (five
# times as long as any other) is among the last: the same straggler in both runs, whatever the phase.
SLOW_JOINS_AT = 33

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _last_tenth_seconds(job: Job) -> float:
    """From the moment 90 % of the records were done to the job's last shard."""
    shards = sorted(job.shards.all(), key=lambda s: ts(s.finished_at))
    total, done = job.total_records or 0, 0
    for shard in shards:
        done += shard.record_count
        if done >= 0.9 * total:
            return ts(shards[-1].finished_at) - ts(shard.finished_at)
    raise AssertionError("the shards do not account for the job's records")


@contextmanager
def _slow_slot_consuming(sim: ChaosStack) -> Iterator[None]:
    from celery import Celery

    with pytest.MonkeyPatch.context() as patch:
        # Celery prefers these variables over a URL given in code; point them at this stack's Redis.
        patch.setenv("CELERY_BROKER_URL", sim.broker_url)
        patch.setenv("CELERY_RESULT_BACKEND", sim.broker_url)
        control = Celery(broker=sim.broker_url, backend=sim.broker_url).control
        destination = [sim.workers[SLOW].hostname]
        assert control.add_consumer("gpu.cpu", destination=destination, reply=True, timeout=5)
        try:
            yield
        finally:
            control.cancel_consumer("gpu.cpu", destination=destination, reply=True, timeout=5)


def _run(sim: ChaosStack, tmp_path: Path, *, speculation: bool) -> tuple[Job, float]:
    sim.stop_control()  # the planning worker too: its ticks read the setting as well
    sim.env["BATCHERY_SPECULATION"] = "true" if speculation else "false"
    sim.start_control()
    wait_consuming(sim)
    job_id, ids, _ = submit(sim, tmp_path, f"spec-{speculation}", SHARDS * 1000)
    wait_for(
        lambda: Job.objects.get(pk=job_id).shards.filter(status=ShardStatus.SUCCEEDED).count() >= SLOW_JOINS_AT,
        timeout_s=120,
        what=f"{SLOW_JOINS_AT} shards committed",
        stack=sim,
    )
    with _slow_slot_consuming(sim):
        job = ended(job_id, sim)
    check_exactly_once(f"stragglers, speculation {speculation}", job, ids, 0)
    return job, _last_tenth_seconds(job)


def test_a_straggler_runs_again_on_an_idle_slot_and_the_first_commit_wins(sim: ChaosStack, tmp_path: Path) -> None:
    sim.workers.pop(SLOW).stop()
    sim.start_slots(1, first=SLOTS - 1, extra_env={"CHAOS_SLOWDOWN": "5"}, queue="standby")
    wait_consuming(sim)

    without, tail_without = _run(sim, tmp_path, speculation=False)
    with_copies, tail_with = _run(sim, tmp_path, speculation=True)

    copies = with_copies.shards.exclude(speculative_task_id="").count()
    report(
        f"stragglers: one of {SLOTS} slots five times slower, joining after {SLOW_JOINS_AT} of {SHARDS} shards of 1 s",
        [
            ("last 10 % of the records, without speculation", f"{tail_without:.2f} s"),
            ("last 10 % of the records, with speculation", f"{tail_with:.2f} s"),
            ("speculative copies sent", str(copies)),
            ("job, without / with", f"{(ts(without.finished_at) - ts(without.created_at)):.1f} s / "
             f"{(ts(with_copies.finished_at) - ts(with_copies.created_at)):.1f} s"),
        ],
    )  # fmt: skip
    assert copies >= 1
    assert not without.shards.exclude(speculative_task_id="").exists()
    assert tail_with <= tail_without / 2, (tail_with, tail_without)

    # The output holds each shard's committed attempt only (check_exactly_once compares the commit
    # markers); the loser, told at its next micro-batch that it lost, deletes what it had written.
    def strays() -> list[str]:
        return [
            path.name
            for shard in with_copies.shards.all()
            for path in (Path(shard.prefix_uri.removeprefix("file://")) / "attempts").iterdir()
            if shard.attempt_id not in path.name
        ]

    wait_for(lambda: not strays(), timeout_s=30, what="the speculative losers to delete their files", stack=sim)
