"""Slots' heartbeats written as slots write them (`heartbeat_commands`: the beat, its place in the
fleet's index, its last-seen time), for tests that need a fleet without starting one."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from tasks.shared.config import gpu_queue
from tasks.shared.fleet import heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot.heartbeat import heartbeat_clear_commands, heartbeat_commands


def slot_beat(*, host: str, slot: int, gpu_class: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """A slot's heartbeat key and beat, in `slot_heartbeat`'s shape, idle unless `fields` say otherwise."""
    beat = {
        "host": host,
        "slot": str(slot),
        "gpu_class": gpu_class,
        "gpus": [],
        "pid": 1,
        "worker": "",
        "queue": gpu_queue(gpu_class),
        "loaded_models": [],
        "current_shard": None,
        "telemetry": [],
        "at": time.time(),
        **fields,
    }
    devices = ",".join(str(gpu) for gpu in beat["gpus"]) or "-"
    return heartbeat_key(host, str(slot), gpu_class=gpu_class, devices=devices), beat


def beats_write(beats: Mapping[str, dict[str, Any]], *, ttl_s: int | None = None) -> None:
    """Write these beats by key as their slots would; `ttl_s` outlasts the heartbeat's TTL where a
    test runs longer than it and no slot renews them."""
    pipe = redis_client().pipeline(transaction=False)
    for key, beat in beats.items():
        heartbeat_commands(pipe, key, beat)
        if ttl_s is not None:
            pipe.expire(key, ttl_s)
    pipe.execute()


def beats_clear(keys: Iterable[str]) -> None:
    """Remove these slots' beats as a clean stop does."""
    pipe = redis_client().pipeline(transaction=False)
    for key in keys:
        heartbeat_clear_commands(pipe, key)
    pipe.execute()


@contextmanager
def live_slots(gpu_class: str, count: int, *, host: str = "host", ttl_s: int = 30) -> Iterator[list[str]]:
    """`count` idle slots of the class consuming its queue, for the block; yields their keys."""
    beats = dict(slot_beat(host=host, slot=slot, gpu_class=gpu_class) for slot in range(count))
    beats_write(beats, ttl_s=ttl_s)
    try:
        yield list(beats)
    finally:
        beats_clear(beats)
