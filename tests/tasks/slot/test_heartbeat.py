from __future__ import annotations

import json

import pytest

from portal.ops.selectors import fleet_slots
from tasks.shared.fleet import HEARTBEAT_TTL_S, heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot import state as slot_state
from tasks.slot.heartbeat import slot_heartbeat


def test_a_slot_heartbeat_says_what_the_slot_holds_and_the_fleet_lists_it_until_its_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHERY_SLOT", "3")
    monkeypatch.setenv("BATCHERY_GPU_CLASS", "h100-80gb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(slot_state, "current_shard", "job-1/7")
    beat = slot_heartbeat()
    assert (beat["slot"], beat["gpu_class"], beat["gpus"], beat["current_shard"]) == (
        "3",
        "h100-80gb",
        [4, 5],
        "job-1/7",
    )
    assert beat["telemetry"] == [], "no NVML on this machine"

    key = heartbeat_key(beat["host"], "3")
    client = redis_client()
    client.set(key, json.dumps(beat), ex=HEARTBEAT_TTL_S)
    try:
        assert beat in fleet_slots()
        assert 0 < client.ttl(key) <= HEARTBEAT_TTL_S
    finally:
        client.delete(key)
    assert beat not in fleet_slots()
