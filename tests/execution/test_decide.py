"""The scheduler's decision, a pure function of what a tick read: no database, no Redis."""

from __future__ import annotations

import copy

from portal.execution.fair_share import TenantQueue, WaitingJob
from portal.execution.scheduler import DispatchPlan, QueueState, decide


def _tenants(shard_cost: float, pending: int = 100) -> list[TenantQueue]:
    heavy = TenantQueue(tenant_id=1, weight=3, usage=0.0, jobs=[WaitingJob("a", 5, 1.0, pending, shard_cost)])
    light = TenantQueue(tenant_id=2, weight=1, usage=0.0, jobs=[WaitingJob("b", 5, 2.0, pending, shard_cost)])
    return [heavy, light]


def test_free_places_are_shared_by_weight_one_shard_a_chord() -> None:
    # 4 slots, 10 s shards: two places a slot, 8 in all; weights 3 : 1.
    state = QueueState(live_slots=4, in_flight=0, tenants=_tenants(10.0), gpus_per_replica=1)
    assert decide(state) == DispatchPlan(shards={"a": 6, "b": 2}, wave=1)


def test_only_the_places_left_by_shards_in_flight_are_filled() -> None:
    state = QueueState(live_slots=4, in_flight=6, tenants=_tenants(10.0), gpus_per_replica=1)
    assert sum(decide(state).shards.values()) == 2
    full = QueueState(live_slots=4, in_flight=8, tenants=_tenants(10.0), gpus_per_replica=1)
    assert decide(full).shards == {}


def test_short_shards_get_a_second_of_work_a_slot_sent_in_waves() -> None:
    # 50 ms shards: 20 places a slot (BATCHERY_SCHEDULER_SECONDS_AHEAD = 1 s), cut in waves of 10.
    state = QueueState(live_slots=4, in_flight=0, tenants=_tenants(0.05), gpus_per_replica=1)
    plan = decide(state)
    assert sum(plan.shards.values()) == 80
    assert plan.wave == 10


def test_a_queue_with_no_known_slot_gets_the_default_window(settings) -> None:
    settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW = 5
    state = QueueState(live_slots=0, in_flight=0, tenants=_tenants(10.0), gpus_per_replica=1)
    assert sum(decide(state).shards.values()) == 5


def test_deciding_leaves_what_was_read_as_it_was() -> None:
    state = QueueState(live_slots=4, in_flight=0, tenants=_tenants(10.0), gpus_per_replica=1)
    before = copy.deepcopy(state)
    decide(state)
    assert state == before
