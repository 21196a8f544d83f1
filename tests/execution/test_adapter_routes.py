"""The scheduler sends a job's shards to the slots that hold its LoRA adapters (by their heartbeats), up to
each slot's places, and the rest to the class queue; the reconciler sends again a routed shard whose slot
no longer takes its own queue. Against the real database, Redis broker and heartbeats."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.utils import timezone

from gpuworkers.spec import AdapterSpec
from portal.execution import capacity
from portal.execution.own_queues import KEY as OWN_QUEUES_KEY
from portal.execution.own_queues import own_queues_retire
from portal.execution.reconcile import STALE_AFTER_S, jobs_reconcile
from portal.execution.scheduler import schedule_queue
from portal.jobs.models import Job, ShardStatus
from tasks.app import app
from tasks.shared.broker_probe import pending_task_ids, priority_lists
from tasks.shared.config import VISIBILITY_TIMEOUT_S, broker_url, gpu_queue, slot_own_queue
from tasks.shared.fleet import draining_key
from tasks.shared.redis_client import redis_client
from tests.execution.test_scheduler import _callbacks_overdue, _running_job
from tests.factories import ModelFactory, TenantFactory
from tests.support.fleet import beats_clear, beats_write, slot_beat

pytestmark = pytest.mark.django_db(transaction=True)

ALPHA = AdapterSpec(name="alpha", version="1", source="/adapters/alpha", rank=4)
BETA = AdapterSpec(name="beta", version="1", source="/adapters/beta", rank=4)
OTHER = AdapterSpec(name="alpha", version="1", source="/adapters/another-tenants-alpha", rank=4)


class Fleet:
    """Slots of one class, by number, each with its own queue and the adapters it holds, as heartbeats."""

    def __init__(self, gpu_class: Any) -> None:
        self.gpu_class = gpu_class
        self.queue = gpu_queue(gpu_class.name)
        self.keys: dict[int, str] = {}

    def worker(self, slot: int) -> str:
        return f"slot{slot}-{self.gpu_class.name}@host"

    def own_queue(self, slot: int) -> str:
        return slot_own_queue(self.queue, self.worker(slot))

    def beat(self, slot: int, *adapters: AdapterSpec) -> None:
        key, beat = slot_beat(
            host="host",
            slot=slot,
            gpu_class=self.gpu_class.name,
            worker=self.worker(slot),
            own_queue=self.own_queue(slot),
            adapters=[adapter.fingerprint for adapter in adapters],
        )
        beats_write({key: beat}, ttl_s=60)
        self.keys[slot] = key
        capacity._cached = None

    def stop(self, slot: int) -> None:
        beats_clear([self.keys.pop(slot)])
        capacity._cached = None

    def queued(self, slot: int | None = None) -> set[str]:
        """Task ids waiting in a slot's own queue (None: the class queue)."""
        view = pending_task_ids([self.queue if slot is None else self.own_queue(slot)])
        assert view is not None
        return view.queued


@pytest.fixture
def fleet(gpu_class: Any) -> Iterator[Fleet]:
    fleet = Fleet(gpu_class)
    yield fleet
    beats_clear(list(fleet.keys.values()))
    redis_client().delete(*(draining_key(fleet.worker(slot)) for slot in range(4)))
    with app.connection_for_write() as connection:
        for slot in range(4):
            connection.SimpleQueue(fleet.own_queue(slot)).clear()
    redis.Redis.from_url(broker_url()).delete(OWN_QUEUES_KEY)


def _adapter_job(model: Any, root: Path, *adapters: AdapterSpec, shards: int) -> Job:
    job = _running_job(TenantFactory(name=f"tuned-{len(adapters)}-{shards}"), model, root, shards=shards)
    job.adapters = {spec.name: {"id": n, "spec": spec.to_dict()} for n, spec in enumerate(adapters, start=1)}
    job.save(update_fields=["adapters"])
    return job


def _routes(job: Job) -> dict[str, set[str]]:
    """The job's dispatched shards' task ids by the queue they were routed to ("" : the class queue)."""
    routes: dict[str, set[str]] = {}
    for slot_queue, task_id in job.shards.filter(status=ShardStatus.DISPATCHED).values_list("slot_queue", "task_id"):
        routes.setdefault(slot_queue, set()).add(task_id)
    return routes


def test_a_jobs_shards_go_to_the_slot_holding_its_adapter_up_to_its_places_and_the_rest_to_the_class_queue(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.beat(0, ALPHA)
    fleet.beat(1)
    fleet.beat(2, BETA)
    model = ModelFactory(name="tuned-base", gpu_class=fleet.gpu_class, is_default=False)
    job = _adapter_job(model, tmp_path, ALPHA, shards=10)

    assert schedule_queue(fleet.queue) == 6  # three slots, two places each

    routes = _routes(job)
    assert {queue: len(ids) for queue, ids in routes.items()} == {fleet.own_queue(0): 2, "": 4}
    # The messages are where the rows say: the holder's own queue, the class queue; none on the others'.
    assert fleet.queued(0) == routes[fleet.own_queue(0)]
    assert fleet.queued() == routes[""]
    assert not fleet.queued(2)


def test_the_slot_holding_most_of_a_jobs_adapters_is_chosen_and_a_full_one_gets_no_more(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.beat(0, ALPHA)
    fleet.beat(1, ALPHA, BETA)
    model = ModelFactory(name="tuned-base", gpu_class=fleet.gpu_class, is_default=False)
    both = _adapter_job(model, tmp_path, ALPHA, BETA, shards=3)

    schedule_queue(fleet.queue)

    # Slot 1 holds both: it gets its two places; slot 0 holds one of them, and takes the third.
    assert {queue: len(ids) for queue, ids in _routes(both).items()} == {fleet.own_queue(1): 2, fleet.own_queue(0): 1}


def test_jobs_without_adapters_drained_slots_and_other_tenants_adapters_of_the_same_name_get_no_route(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.beat(0, ALPHA)
    fleet.beat(1, OTHER)
    redis_client().set(draining_key(fleet.worker(0)), "{}")
    model = ModelFactory(name="tuned-base", gpu_class=fleet.gpu_class, is_default=False)
    plain = _running_job(TenantFactory(name="plain"), model, tmp_path, shards=2)
    tuned = _adapter_job(model, tmp_path, ALPHA, shards=2)

    schedule_queue(fleet.queue)

    assert set(_routes(plain)) == {""}
    # Slot 0 holds alpha but is drained; slot 1's "alpha@1" is another tenant's files (another fingerprint).
    assert set(_routes(tuned)) == {""}
    assert ALPHA.fingerprint != OTHER.fingerprint


def test_a_shard_waiting_on_a_dead_slots_own_queue_is_sent_again_to_the_class_queue(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.beat(0, ALPHA)
    model = ModelFactory(name="tuned-base", gpu_class=fleet.gpu_class, is_default=False)
    job = _adapter_job(model, tmp_path, ALPHA, shards=2)
    schedule_queue(fleet.queue)
    assert set(_routes(job)) == {fleet.own_queue(0)}
    _callbacks_overdue(job)
    job.shards.update(dispatched_at=timezone.now() - dt.timedelta(seconds=STALE_AFTER_S))

    # While its slot lives, a routed message waiting on its queue is no loss.
    assert jobs_reconcile().resent_shards == 0

    fleet.stop(0)
    report = jobs_reconcile()

    assert report.resent_shards == 2
    assert set(job.shards.values_list("attempt", flat=True)) == {2}
    assert _routes(job).keys() == {""}, "sent again to the class queue, which other slots take"
    assert fleet.queued() == _routes(job)[""]


def test_a_dead_slots_own_queue_is_emptied_once_its_shards_were_sent_again_and_a_live_slots_never(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.beat(0, ALPHA)
    fleet.beat(1, BETA)
    model = ModelFactory(name="tuned-base", gpu_class=fleet.gpu_class, is_default=False)
    alpha_job = _adapter_job(model, tmp_path, ALPHA, shards=2)
    beta_job = _adapter_job(model, tmp_path, BETA, shards=2)
    schedule_queue(fleet.queue)
    assert set(_routes(alpha_job)) == {fleet.own_queue(0)} and set(_routes(beta_job)) == {fleet.own_queue(1)}
    first_messages = fleet.queued(0)
    assert len(first_messages) == 2
    broker = redis.Redis.from_url(broker_url())
    raw_messages = [(key, raw) for key in priority_lists(fleet.own_queue(0)) for raw in broker.lrange(key, 0, -1)]

    _callbacks_overdue(alpha_job)
    alpha_job.shards.update(dispatched_at=timezone.now() - dt.timedelta(seconds=STALE_AFTER_S))
    fleet.stop(0)
    assert jobs_reconcile().resent_shards == 2
    assert fleet.queued(0) == first_messages, "the first messages are left on the dead slot's queue"

    now = time.time()
    assert own_queues_retire(now=now) == 0, "a slot gone a moment ago may be restarting"
    assert own_queues_retire(now=now + STALE_AFTER_S + 1) == 1
    assert fleet.queued(0) == set(), "the copies of shards sent again are gone"
    assert fleet.queued(1) == set(_routes(beta_job)[fleet.own_queue(1)]), "a live slot's queue is kept"

    # A message the dead slot held unacknowledged comes back to its queue once the visibility timeout has passed.
    broker.rpush(*raw_messages[0])
    assert own_queues_retire(now=now + VISIBILITY_TIMEOUT_S) == 1
    assert fleet.queued(0) == set()
    assert broker.hexists(OWN_QUEUES_KEY, fleet.own_queue(0))
    own_queues_retire(now=now + 2 * VISIBILITY_TIMEOUT_S + STALE_AFTER_S + 1)
    assert not broker.hexists(OWN_QUEUES_KEY, fleet.own_queue(0)), "forgotten once nothing can come back"

    # An entry that is not one of the scheduler's is dropped, and stops no sweep.
    broker.hset(OWN_QUEUES_KEY, "gpu.cpu.slot.garbled", b"not json")
    own_queues_retire(now=now)
    assert not broker.hexists(OWN_QUEUES_KEY, "gpu.cpu.slot.garbled")

    # A slot that dies with routed shards not yet sent again keeps them on its queue until the reconciler has.
    fleet.stop(1)
    assert own_queues_retire(now=now + 2 * VISIBILITY_TIMEOUT_S + STALE_AFTER_S + 1) == 0
    assert fleet.queued(1) == set(_routes(beta_job)[fleet.own_queue(1)])
