"""Own queues that no slot takes any more are emptied, so that a dead slot's routed messages do not stay in
Redis for ever.

The scheduler notes each slot's own queue it routes a shard to (`own_queues_note`, `adapter_routes`). When
that slot dies or is drained, the reconciler sends its routed shards again to the class queue
(`reconcile._lost`), and their first messages are left on the own queue: they would only run as duplicates
if the slot came back. Each sweep, `own_queues_retire` empties the own queue of a slot that no live,
undrained slot has taken for BATCHERY_RECONCILE_STALE_AFTER_S, once no shard routed there waits any more
(so every message left is a copy of one sent again), and forgets the queue once twice the visibility
timeout has passed, by when the broker has given back any message the slot held unacknowledged (and a
sweep has emptied it too).

A route made to a slot whose heartbeat came back in the moment between a sweep's check and its emptying
loses its message; the reconciler then finds its shard lost and sends it again, as for any lost message.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import redis
from django.conf import settings

from portal.execution.adapter_routes import slot_takes
from portal.jobs.models import Shard, ShardStatus
from tasks.shared.broker_probe import priority_lists
from tasks.shared.config import VISIBILITY_TIMEOUT_S, broker_url

logger = logging.getLogger(__name__)

KEY = "batchery:own-queues"
"""Hash in the broker's Redis: own queue -> {"queue": its class queue, "taken": when a slot last took it}."""


def own_queues_note(queue: str, own_queues: Iterable[str]) -> None:
    """Note that the scheduler routed shards to `own_queues`, own queues of slots of the class queue `queue`."""
    entry = json.dumps({"queue": queue, "taken": time.time()})
    client = _broker()
    if client is None:
        return
    try:
        with client, client.pipeline(transaction=False) as pipe:
            for own_queue in own_queues:
                pipe.hset(KEY, own_queue, entry)
            pipe.execute()
    except redis.RedisError as exc:
        # The messages go all the same: a queue not noted is only one a dead slot may leave full.
        logger.warning("cannot note the own queues routed to: %s", exc)


def own_queues_retire(now: float | None = None) -> int:
    """Empty the own queues no slot takes any more (see the module's docstring); the number emptied."""
    client = _broker()
    if client is None:
        return 0
    now = time.time() if now is None else now
    stale_after = settings.BATCHERY_RECONCILE_STALE_AFTER_S
    emptied = 0
    try:
        with client, client.pipeline(transaction=False) as taken:
            for name, raw_entry in client.hgetall(KEY).items():
                own_queue = name.decode() if isinstance(name, bytes) else name
                entry = _entry(raw_entry)
                if entry is None:
                    client.hdel(KEY, own_queue)  # not this module's writing: one bad entry stops no sweep
                    continue
                if slot_takes(own_queue, entry["queue"]):
                    taken.hset(KEY, own_queue, json.dumps({**entry, "taken": now}))
                    continue
                idle = now - entry["taken"]
                if idle <= stale_after or _waiting_on(own_queue):
                    continue
                emptied += bool(client.delete(*priority_lists(own_queue)))
                if idle > 2 * VISIBILITY_TIMEOUT_S + stale_after:
                    client.hdel(KEY, own_queue)
            taken.execute()
    except redis.RedisError as exc:
        logger.warning("cannot empty the own queues no slot takes; the next sweep tries again: %s", exc)
    return emptied


def _entry(raw: bytes | str) -> dict[str, Any] | None:
    """An entry of KEY, {"queue": str, "taken": float}; None where it is not one."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if isinstance(entry, dict) and isinstance(entry.get("queue"), str) and isinstance(entry.get("taken"), float | int):
        return entry
    return None


def _waiting_on(own_queue: str) -> bool:
    """Whether a shard routed to `own_queue` is still dispatched there: the reconciler has yet to send it again."""
    return Shard.objects.filter(status=ShardStatus.DISPATCHED, slot_queue=own_queue).exists()


def _broker() -> redis.Redis | None:
    url = broker_url()
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
