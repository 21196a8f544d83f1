"""How many shards a GPU queue may hold at once: its window, from the slots that consume it.

A slot with prefetch 1 holds the shard it runs and takes the next from the broker as soon as it
finishes, so two shards per live slot keep it busy while the scheduler refills the window; more
would only lengthen the wait of a tenant that arrives later. Slots are known by their heartbeats
(launcher slots); a queue consumed by plain workers, or read while Redis is down, gets a default.
"""

from __future__ import annotations

import time
from collections import Counter

from django.conf import settings

from portal.ops.selectors import draining_workers, fleet_slots

_CACHE_S = 2.0
_cached: tuple[float, Counter[str]] | None = None


def _slots_by_queue() -> Counter[str]:
    """Live slots per queue, read at most every `_CACHE_S` seconds per process."""
    global _cached
    now = time.monotonic()
    if _cached is not None and now - _cached[0] < _CACHE_S:
        return _cached[1]
    slots = fleet_slots()
    draining = draining_workers([slot.get("worker", "") for slot in slots])
    live: Counter[str] = Counter()
    for slot in slots:
        if slot.get("worker", "") in draining or not slot.get("queue"):
            continue
        live[slot["queue"]] += 1
    _cached = (now, live)
    return live


def live_slots(queue: str) -> int:
    return _slots_by_queue()[queue]


def queue_slots(queue: str) -> int:
    """The slots consuming the queue: its live slots, or as many as the default window assumes."""
    per_slot = settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT
    return live_slots(queue) or max(1, settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW // per_slot)


def queue_window(queue: str) -> int:
    """The most shards of this queue that may be sent and not yet finished."""
    slots = live_slots(queue)
    if slots == 0:
        return settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW
    return slots * settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT
