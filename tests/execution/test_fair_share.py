"""The fair-share order: decayed usage over weight, charged as shards are chosen; priority within a tenant."""

from __future__ import annotations

import pytest

from portal.execution.fair_share import TenantQueue, WaitingJob, decayed, share_out


def _job(
    job_id: str, *, pending: int = 1000, priority: int = 5, created_at: float = 0.0, cost: float = 1.0
) -> WaitingJob:
    return WaitingJob(job_id=job_id, priority=priority, created_at=created_at, pending=pending, shard_cost=cost)


def test_usage_halves_every_half_life() -> None:
    assert decayed(80.0, 0, 10) == 80.0
    assert decayed(80.0, 10, 10) == pytest.approx(40.0)
    assert decayed(80.0, 30, 10) == pytest.approx(10.0)


def test_free_places_are_shared_in_proportion_to_the_weights() -> None:
    heavy = TenantQueue(tenant_id=1, weight=3, usage=0, jobs=[_job("a")])
    light = TenantQueue(tenant_id=2, weight=1, usage=0, jobs=[_job("b")])

    chosen, charged = share_out(400, [heavy, light])

    assert chosen == {"a": 300, "b": 100}
    assert charged == {1: 300.0, 2: 100.0}


def test_a_tenant_that_used_little_recently_goes_first_until_it_catches_up() -> None:
    busy = TenantQueue(tenant_id=1, weight=1, usage=50, jobs=[_job("a")])
    newcomer = TenantQueue(tenant_id=2, weight=1, usage=0, jobs=[_job("b")])

    chosen, _ = share_out(60, [busy, newcomer])

    # 50 shards to catch up, then the remaining 10 alternate.
    assert chosen == {"b": 55, "a": 5}


def test_costlier_shards_count_for_more() -> None:
    cheap = TenantQueue(tenant_id=1, weight=1, usage=0, jobs=[_job("a", cost=1.0)])
    dear = TenantQueue(tenant_id=2, weight=1, usage=0, jobs=[_job("b", cost=4.0)])

    chosen, charged = share_out(50, [cheap, dear])

    assert chosen == {"a": 40, "b": 10}
    assert charged[1] == charged[2] == 40.0


def test_within_a_tenant_higher_priority_then_older_jobs_go_first() -> None:
    tenant = TenantQueue(
        tenant_id=1,
        weight=1,
        usage=0,
        jobs=[
            _job("old-low", priority=0, created_at=1, pending=5),
            _job("new-high", priority=9, created_at=3, pending=2),
            _job("older-mid", priority=5, created_at=0, pending=2),
            _job("newer-mid", priority=5, created_at=2, pending=2),
        ],
    )

    chosen, _ = share_out(7, [tenant])

    assert list(chosen.items()) == [("new-high", 2), ("older-mid", 2), ("newer-mid", 2), ("old-low", 1)]


def test_nothing_is_chosen_beyond_what_waits() -> None:
    tenant = TenantQueue(tenant_id=1, weight=1, usage=0, jobs=[_job("a", pending=3)])

    chosen, _ = share_out(10, [tenant])

    assert chosen == {"a": 3}
