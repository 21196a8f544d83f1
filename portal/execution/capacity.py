"""How many shards a GPU queue may hold at once: its window, from the slots that consume it.

A slot with prefetch 1 holds the shard it runs and takes the next from the broker as soon as it
finishes, so two shards per live slot keep it busy while the scheduler refills the window; more
would only lengthen the wait of a tenant that arrives later. Shards shorter than the time their
endings take to settle get more places, up to a second of work a slot (`shards_per_slot`). Slots
are known by their heartbeats (launcher slots); a queue consumed by plain workers, or read while
Redis is down, gets a default.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from portal.ops.selectors import draining_workers, fleet_slots

_CACHE_S = 2.0


@dataclass(frozen=True)
class _Fleet:
    read_at: float
    beats: list[dict[str, Any]]
    """The heartbeats of the live slots that are not drained."""
    by_queue: Counter[str]


_cached: _Fleet | None = None


def _fleet() -> _Fleet:
    """The live slots that take shards, read at most every `_CACHE_S` seconds per process."""
    global _cached
    now = time.monotonic()
    if _cached is not None and now - _cached.read_at < _CACHE_S:
        return _cached
    slots = fleet_slots()
    draining = draining_workers([slot.get("worker", "") for slot in slots])
    beats = [slot for slot in slots if slot.get("queue") and slot.get("worker", "") not in draining]
    _cached = _Fleet(read_at=now, beats=beats, by_queue=Counter(beat["queue"] for beat in beats))
    return _cached


def live_slots(queue: str) -> int:
    return _fleet().by_queue[queue]


def live_beats(queue: str) -> list[dict[str, Any]]:
    """The heartbeats of the slots that take `queue`'s shards now (live, not drained)."""
    return [beat for beat in _fleet().beats if beat["queue"] == queue]


def queue_slots(queue: str) -> int:
    """The slots consuming the queue: its live slots, or as many as the default window assumes."""
    return slots_or_default(live_slots(queue))


def wave_size(queue: str, shard_seconds: float | None = None) -> int:
    """The most shards of a job sent as one chord on this queue (`wave_for` its live slots)."""
    return wave_for(live_slots(queue), shard_seconds)


def slots_or_default(live: int) -> int:
    """`live` slots, or where none is known (plain workers, Redis unread) as many as the default window assumes."""
    per_slot = settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT
    return live or max(1, settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW // per_slot)


def shards_per_slot(shard_seconds: float | None = None) -> int:
    """Shards a slot holds at a time: two, or for shards so short that settling one takes about as
    long as running one, enough of them to cover `BATCHERY_SCHEDULER_SECONDS_AHEAD` of work."""
    least = settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT
    if not shard_seconds or shard_seconds <= 0:
        return least
    ahead = math.ceil(settings.BATCHERY_SCHEDULER_SECONDS_AHEAD / shard_seconds)
    return max(least, min(ahead, settings.BATCHERY_SCHEDULER_MAX_SHARDS_PER_SLOT))


def window_for(live: int, shard_seconds: float | None = None) -> int:
    """The most shards that `live` slots may hold sent and not yet finished, for waiting shards estimated
    at `shard_seconds` each (the longest of them: a late tenant waits behind no more)."""
    if live == 0:
        return settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW
    return live * shards_per_slot(shard_seconds)


def wave_for(live: int, shard_seconds: float | None = None) -> int:
    """The most shards of a job sent as one chord (a wave), settled together when its last one ends.

    One, unless shards are so short that a slot gets more than its two places (`shards_per_slot`):
    then a slot's places are cut in two waves, so that while one wave's ending is settled the slot
    runs the other. A wave of short shards pays for one callback, one tick and one look at the merge,
    where each shard alone paid for its own. A long shard always goes alone, so that its place frees
    the moment it ends.
    """
    least = settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT
    return max(1, window_for(live, shard_seconds) // (slots_or_default(live) * least))
