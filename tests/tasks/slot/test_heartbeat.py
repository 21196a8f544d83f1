from __future__ import annotations

import json
import time
import uuid

import pytest

from portal.ops.selectors import fleet_slots
from tasks.shared.fleet import FLEET_INDEX_KEY, HEARTBEAT_TTL_S, LAST_SEEN_KEY, heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot import state as slot_state
from tasks.slot.heartbeat import heartbeat_clear_commands, heartbeat_commands, slot_heartbeat


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
    assert key == heartbeat_key(beat["host"], "3", gpu_class="h100-80gb", devices="4,5")
    client = redis_client()
    pipe = client.pipeline(transaction=False)
    heartbeat_commands(pipe, key, beat)
    pipe.execute()
    try:
        assert beat in fleet_slots()
        assert 0 < client.ttl(key) <= HEARTBEAT_TTL_S
        assert json.loads(client.hget(LAST_SEEN_KEY, key) or b"{}")["at"] == beat["at"]
    finally:
        pipe = client.pipeline(transaction=False)
        heartbeat_clear_commands(pipe, key)
        pipe.execute()
    assert beat not in fleet_slots()
    assert not client.sismember(FLEET_INDEX_KEY, key), "a clean stop leaves nothing in the index"
    assert not client.hexists(LAST_SEEN_KEY, key), "nor a last-seen time to alert on"


def test_a_simulated_slot_names_itself_without_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_GPU_CLASS", "cpu")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    assert heartbeat_key("sim-host", "7", gpu_class="a10g-24gb", devices="7") == "batchery:fleet:sim-host:a10g-24gb:7:7"
    assert heartbeat_key("sim-host", "7", gpu_class="a10g-24gb", devices="") == "batchery:fleet:sim-host:a10g-24gb:7:-"
    assert heartbeat_key("sim-host", "7") == "batchery:fleet:sim-host:cpu:7:-"


def test_a_slot_that_died_drops_out_and_leaves_the_index_but_keeps_its_last_seen_time_for_the_alert() -> None:
    host = f"dead-host-{uuid.uuid4().hex[:8]}"
    key = heartbeat_key(host, "0", gpu_class="a100", devices="0")
    beat = {**slot_heartbeat(), "host": host, "slot": "0", "gpu_class": "a100"}
    client = redis_client()
    pipe = client.pipeline(transaction=False)
    heartbeat_commands(pipe, key, beat)
    pipe.execute()
    try:
        assert any(slot["host"] == host for slot in fleet_slots())

        client.pexpire(key, 50)  # a slot that stopped beating without a clean stop: its TTL runs out
        time.sleep(0.2)

        assert not any(slot["host"] == host for slot in fleet_slots())
        assert not client.sismember(FLEET_INDEX_KEY, key), "the reader forgot it"
        assert client.hexists(LAST_SEEN_KEY, key)

        pipe = client.pipeline(transaction=False)
        heartbeat_commands(pipe, key, beat)
        pipe.execute()
        assert any(slot["host"] == host for slot in fleet_slots()), "back at its next beat"
    finally:
        pipe = client.pipeline(transaction=False)
        heartbeat_clear_commands(pipe, key)
        pipe.execute()
