"""The fleet as its readers see it (the portal's pages, /metrics, the scheduler's windows): the live
slots, read through the fleet's index in a bounded number of round trips, drained ones marked."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet_scale import counted_round_trips
from portal.execution import capacity
from portal.ops.selectors import fleet_overview, fleet_slots
from tasks.shared.config import gpu_queue
from tasks.shared.fleet import draining_key
from tasks.shared.redis_client import redis_client
from tests.support.fleet import beats_clear, beats_write, slot_beat

OTHER_KEYS = 3_000


@pytest.fixture
def fleet() -> Iterator[dict[str, dict]]:
    """Three live slots of a class on one host, the first running a shard and the last drained."""
    host = f"fleet-{uuid.uuid4().hex[:8]}"
    gpu_class = f"class-{uuid.uuid4().hex[:6]}"
    beats = dict(
        slot_beat(
            host=host,
            slot=slot,
            gpu_class=gpu_class,
            gpus=[slot],
            worker=f"slot{slot}-{gpu_class}@{host}",
            current_shard="job-1/4" if slot == 0 else None,
        )
        for slot in range(3)
    )
    beats_write(beats, ttl_s=60)
    drained = list(beats.values())[-1]["worker"]
    client = redis_client()
    client.set(draining_key(drained), "1", ex=60)
    capacity._cached = None
    try:
        yield beats
    finally:
        beats_clear(beats)
        client.delete(draining_key(drained))
        capacity._cached = None


def _ours(slots: list[dict], beats: dict[str, dict]) -> list[dict]:
    host = next(iter(beats.values()))["host"]
    return [slot for slot in slots if slot["host"] == host]


def test_the_fleet_is_read_in_a_few_round_trips_however_many_other_keys_redis_holds(
    fleet: dict[str, dict],
) -> None:
    client = redis_client()
    others = [f"fleet-test-other:{uuid.uuid4().hex}:{n}" for n in range(OTHER_KEYS)]
    pipe = client.pipeline(transaction=False)
    for key in others:
        pipe.set(key, "x", ex=60)
    pipe.execute()
    try:
        with counted_round_trips() as counts:
            slots = fleet_slots()
    finally:
        client.delete(*others)

    assert len(_ours(slots, fleet)) == 3
    # A SCAN of the keyspace would walk the other keys too, 500 a round trip.
    assert counts["round_trips"] <= 3, counts


def test_the_overview_and_the_window_see_the_live_slots_and_honour_the_drain(fleet: dict[str, dict]) -> None:
    beats = list(fleet.values())
    queue = gpu_queue(beats[0]["gpu_class"])

    overview = _ours(fleet_overview(), fleet)

    assert [(slot["slot"], slot["draining"]) for slot in overview] == [("0", False), ("1", False), ("2", True)]
    assert all(0 <= slot["age_s"] < 60 for slot in overview)
    assert capacity.live_slots(queue) == 2, "the drained slot takes no shards: it sizes no window"


def test_a_read_while_redis_is_unreachable_finds_no_slot_and_the_window_falls_back_to_its_default(
    monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    monkeypatch.setenv("BATCHERY_PROGRESS_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    capacity._cached = None
    try:
        assert fleet_slots() == []
        assert fleet_overview() == []
        assert capacity.queue_slots("gpu.anything") == capacity.slots_or_default(0)
    finally:
        capacity._cached = None


@pytest.mark.django_db
def test_metrics_count_the_live_busy_and_drained_slots_by_class_and_each_slots_last_heartbeat(
    fleet: dict[str, dict],
) -> None:
    beats = list(fleet.values())
    gpu_class = beats[0]["gpu_class"]

    scrape = Client(HTTP_HOST="localhost").get("/metrics")

    assert scrape.status_code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(scrape.content.decode())
        for sample in family.samples
    }
    for name, count in (("batchery_slots_alive", 3), ("batchery_slots_busy", 1), ("batchery_slots_draining", 1)):
        assert samples[(name, (("gpu_class", gpu_class),))] == count, name
    for beat in beats:
        labels = (("gpu_class", gpu_class), ("host", beat["host"]), ("slot", beat["slot"]))
        assert samples[("batchery_slot_last_heartbeat_timestamp_seconds", labels)] == pytest.approx(beat["at"])
