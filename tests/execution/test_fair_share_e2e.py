"""Fair share with real workers (see `tests/execution/conftest.py` for the simulated fleet)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.fairness import busy_seconds, slot_busy_fractions
from portal.jobs.models import JobStatus
from tests.execution.conftest import (
    HALF_LIFE_S,
    SLOTS,
    ended,
    finished_shards,
    report,
    submit,
    ts,
    wait_status,
)
from tests.factories import TenantFactory
from tests.support.chaos import ChaosStack, check_exactly_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_a_small_job_behind_a_large_one_starts_at_once_and_both_end_exactly_once(
    sim: ChaosStack, tmp_path: Path
) -> None:
    a_id, a_ids, a_submitted = submit(sim, tmp_path, "team-a", 100_000)
    wait_status(a_id, {JobStatus.RUNNING}, 60, sim)
    time.sleep(max(0.0, a_submitted + 10 - time.time()))
    b_id, b_ids, _ = submit(sim, tmp_path, "team-b", 100)

    b = ended(b_id, sim, timeout_s=60)
    b_first_start = min(ts(s.started_at) for s in b.shards.all() if s.started_at)
    b_wait, b_total = b_first_start - ts(b.created_at), ts(b.finished_at) - ts(b.created_at)
    a = ended(a_id, sim)
    check_exactly_once("team-a behind", a, a_ids, 0)
    check_exactly_once("team-b small", b, b_ids, 0)
    report(
        "A 100,000 records, B 100 records 10 s later (4 slots, 1 ms a record, 1 s shards)",
        [
            ("B's first shard started after its submission", f"{b_wait:.2f} s"),
            ("B ended after its submission", f"{b_total:.2f} s"),
            ("A's shards", str(a.shard_count)),
            ("A ended", a.status),
        ],
    )
    assert b.status == a.status == JobStatus.SUCCEEDED
    assert b_wait <= 5, f"B's first shard started {b_wait:.1f} s after its submission"
    assert b_total <= 15, f"B ended {b_total:.1f} s after its submission"


def test_weights_share_the_fleet_a_newcomer_gets_its_share_and_slots_stay_busy(sim: ChaosStack, tmp_path: Path) -> None:
    TenantFactory(name="heavy", weight=3)
    TenantFactory(name="light", weight=1)
    TenantFactory(name="late", weight=1)
    heavy_id, _, _ = submit(sim, tmp_path, "heavy", 250_000)
    light_id, _, _ = submit(sim, tmp_path, "light", 150_000)
    for job_id in (heavy_id, light_id):
        wait_status(job_id, {JobStatus.RUNNING}, 60, sim)
    start = time.time() + 5
    time.sleep(35)
    late_id, _, late_submitted = submit(sim, tmp_path, "late", 100_000)
    time.sleep(HALF_LIFE_S + 5)
    busy_end = time.time() - 3  # shards running at the end settle within a second or two
    time.sleep(3)

    shards = finished_shards(heavy_id, light_id, late_id)
    mid = late_submitted
    heavy_s, light_s = busy_seconds(shards[heavy_id], start, mid), busy_seconds(shards[light_id], start, mid)
    window_end = late_submitted + HALF_LIFE_S
    late_share = busy_seconds(shards[late_id], late_submitted, window_end) / (SLOTS * HALF_LIFE_S)
    busy_fractions = slot_busy_fractions([s for group in shards.values() for s in group], start, busy_end)
    for job_id in (heavy_id, light_id, late_id):
        sim.manage("job", "cancel", job_id)
    for job_id in (heavy_id, light_id, late_id):
        ended(job_id, sim, timeout_s=60)

    ratio = heavy_s / light_s
    report(
        "weights 3 and 1 with more work than the fleet; weight 1 arriving 35 s later (4 slots)",
        [
            (f"heavy : light GPU-seconds over {mid - start:.0f} s", f"{heavy_s:.1f} : {light_s:.1f} = {ratio:.2f}"),
            (f"late's share of the fleet in its first {HALF_LIFE_S} s", f"{late_share:.2f} (weight share 0.20)"),
            ("slot busy fraction, lowest", f"{min(busy_fractions.values()):.3f}"),
            ("slot busy fraction, each", ", ".join(f"{v:.3f}" for v in sorted(busy_fractions.values()))),
        ],
    )
    assert abs(ratio / 3 - 1) <= 0.10, f"heavy:light = {ratio:.2f}, not within 10 % of 3"
    assert late_share >= 0.20 * 0.9, f"late had {late_share:.2f} of the fleet in its first window"
    assert len(busy_fractions) == SLOTS
    assert min(busy_fractions.values()) >= 0.95, busy_fractions


def test_within_a_tenant_a_later_priority_9_job_goes_before_a_priority_0_one(sim: ChaosStack, tmp_path: Path) -> None:
    TenantFactory(name="prio", priority=9)
    low_id, low_ids, _ = submit(sim, tmp_path, "prio", 40_000, "--priority", "0")
    wait_status(low_id, {JobStatus.RUNNING}, 60, sim)
    time.sleep(3)
    high_id, high_ids, _ = submit(sim, tmp_path, "prio", 5_000, "--priority", "9")
    high = ended(high_id, sim, timeout_s=120)
    low = ended(low_id, sim, timeout_s=240)
    check_exactly_once("priority 9", high, high_ids, 0)
    check_exactly_once("priority 0", low, low_ids, 0)

    high_running = ts(high.started_at)
    high_last_sent = max(ts(s.dispatched_at) for s in high.shards.all())
    low_sent_meanwhile = [s.index for s in low.shards.all() if high_running < ts(s.dispatched_at) < high_last_sent]
    report(
        "one tenant: priority 0 job, then a priority 9 job 3 s later",
        [
            ("priority 0 shards sent while the priority 9 job had shards waiting", str(len(low_sent_meanwhile))),
            ("priority 9 job ended before the priority 0 one", str(high.finished_at < low.finished_at)),
        ],
    )
    assert low_sent_meanwhile == []
    assert high.finished_at < low.finished_at


def test_redis_lost_mid_run_with_three_tenants_every_job_ends_exactly_once_and_fair_share_resumes(
    sim: ChaosStack, tmp_path: Path
) -> None:
    submitted = [submit(sim, tmp_path, f"tenant-{n}", 80_000) for n in range(3)]
    for job_id, _, _ in submitted:
        wait_status(job_id, {JobStatus.RUNNING}, 60, sim)
    time.sleep(4)
    sim.restart_redis_empty()
    restarted = time.time()
    # From the reconciler's first sweep after the restart until well before the first job can end:
    # about a hundred 1-second shards, so that one shard more or less moves a share by 1 %.
    time.sleep(36)
    shards = finished_shards(*(job_id for job_id, _, _ in submitted))
    shares = [busy_seconds(shards[job_id], restarted + 8, restarted + 33) for job_id, _, _ in submitted]
    jobs = [ended(job_id, sim) for job_id, _, _ in submitted]
    for job, (_, ids, _) in zip(jobs, submitted, strict=True):
        check_exactly_once("Redis lost, three tenants", job, ids, 0)
    fractions = [share / sum(shares) for share in shares]
    report(
        "Redis restarted empty mid-run, three tenants of weight 1",
        [("shares 8-33 s after the restart", ", ".join(f"{f:.2f}" for f in fractions))]
        + [(f"tenant-{n}", job.status) for n, job in enumerate(jobs)],
    )
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs)
    assert all(abs(f * 3 - 1) <= 0.25 for f in fractions), fractions
