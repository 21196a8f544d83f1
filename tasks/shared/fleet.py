"""The fleet's keys in Redis: each slot's heartbeat (with a TTL), the index of them, each slot's last-seen
time and the draining marks.

Slots write them (`tasks.slot.heartbeat.heartbeat_commands`); the portal reads them to list the fleet,
size the GPU queues' windows and drain workers. Readers find the beats through the index
(`live_beats`), in a fixed number of round trips whatever the fleet's size and whatever else the
Redis holds: a SCAN for the beats' keys walked the whole keyspace, results and progress counters
included (millions at 50 shard endings a second kept 14 days), in hundreds of round trips a read.
"""

from __future__ import annotations

import os

import redis

from gpuworkers.settings import slot_gpu_class
from tasks.shared.config import HEARTBEAT_INTERVAL_S

HEARTBEAT_TTL_S = 3 * HEARTBEAT_INTERVAL_S
FLEET_KEY_PREFIX = "batchery:fleet:"
# Every slot's last heartbeat time, by heartbeat key: outlives the beat itself, so that /metrics can
# show a slot whose heartbeat stopped (an alert), until the slot stops cleanly or a day has passed.
LAST_SEEN_KEY = "batchery:fleet-last-seen"
# The heartbeat key of every slot that beat and did not stop cleanly: each beat adds its key, a clean
# stop removes it, and a reader removes the keys whose beat expired (a slot that died). The beat's
# own key keeps its TTL, so that a slot drops out within one TTL by Redis's clock, not a host's.
FLEET_INDEX_KEY = "batchery:fleet-index"
DRAINING_KEY_PREFIX = "batchery:draining:"
# A drained worker stays idle until it is restarted, which clears the mark; this only bounds a
# mark left by a worker that vanished.
DRAINING_TTL_S = 7 * 24 * 3600


def heartbeat_key(host: str, slot: str, *, gpu_class: str | None = None, devices: str | None = None) -> str:
    """One key per slot: a host may run launchers of several classes, each numbering its slots.

    The class and the devices (`CUDA_VISIBLE_DEVICES`'s form, `-` for none) default to this process's
    own; a writer of many slots' beats (the fleet simulator) names each slot with them.
    """
    if gpu_class is None:
        gpu_class = slot_gpu_class()
    if devices is None:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES") or "-"
    return f"{FLEET_KEY_PREFIX}{host}:{gpu_class}:{slot}:{devices or '-'}"


def draining_key(worker: str) -> str:
    """Set while the slot worker of this Celery node name takes no new shards."""
    return f"{DRAINING_KEY_PREFIX}{worker}"


# Removes from the index (KEYS[1]) those of the other keys that do not exist, checked and removed at
# once: a slot that beats again between a reader's read and its removal keeps its place.
_PRUNE = """
for i = 2, #KEYS do
    if redis.call('EXISTS', KEYS[i]) == 0 then
        redis.call('SREM', KEYS[1], KEYS[i])
    end
end
"""


def live_beats(client: redis.Redis) -> list[bytes | str]:
    """Every live slot's beat (its JSON), by heartbeat key, in two round trips (a third when some slot
    died since the last read, to forget it). Raises `redis.RedisError`."""
    keys = sorted(client.smembers(FLEET_INDEX_KEY))
    values = client.mget(keys) if keys else []
    dead = [key for key, value in zip(keys, values, strict=True) if value is None]
    if dead:
        client.register_script(_PRUNE)(keys=[FLEET_INDEX_KEY, *dead])
    return [value for value in values if value is not None]
