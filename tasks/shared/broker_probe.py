"""What messages the broker holds: queued or delivered-but-unacknowledged task ids, and how many.

The reconciler uses it to tell a lost shard message from one that is merely waiting in a queue;
the portal's /metrics uses `queue_depths` for each queue's backlog.
Kombu's Redis transport keeps each queue as a list (one list per priority step) and delivered
messages in the `unacked` hash; both hold the task id in the message headers, and a wave's message
(`tasks.slot.run_shard.run_shards`) its shards' task ids in its arguments. For any other broker
the answer is None ("cannot tell"), and the reconciler falls back to waiting out the visibility
timeout.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from tasks.shared.config import WAVE_TASK, broker_url

logger = logging.getLogger(__name__)

PRIORITY_SEPARATOR = "\x06\x16"
SCAN_CHUNK = 1000
# kombu keeps priority p of a queue in `<queue>` for p == 0 and `<queue>\x06\x16<p>` otherwise; the
# Celery config declares every step from 0 to 9 (`tasks.shared.config.celery_settings`).
PRIORITY_STEPS = range(10)


def _task_ids(raw: bytes | str) -> list[str]:
    """The task ids a raw message stands for: its own, and for a wave (`WAVE_TASK`) each of its shards'."""
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        return []
    if isinstance(payload, list):  # unacked entries are [message, exchange, routing_key]
        payload = payload[0] if payload else {}
    if not isinstance(payload, dict):
        return []
    headers = payload.get("headers") or {}
    task_id = headers.get("id")
    ids = [str(task_id)] if task_id else []
    if headers.get("task") == WAVE_TASK:
        ids.extend(_wave_shard_ids(payload))
    return ids


def _wave_shard_ids(payload: dict[str, Any]) -> list[str]:
    """The shard task ids a wave's message carries in its arguments (`[[task id, spec, limit], ...]`)."""
    try:
        body: Any = payload.get("body") or ""
        if (payload.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        [shards], _, _ = json.loads(body)
        return [str(task_id) for task_id, *_ in shards]
    except (ValueError, TypeError):
        logger.warning("a wave's message could not be read for its shards' ids")
        return []


@dataclass(frozen=True)
class BrokerView:
    queued: set[str]
    """Task ids waiting in a queue."""
    unacked: set[str]
    """Task ids delivered to a worker and not yet acknowledged."""

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.queued or task_id in self.unacked


def pending_task_ids(queues: Iterable[str]) -> BrokerView | None:
    """Task ids waiting in `queues` or delivered and not yet acknowledged; None if unknowable."""
    url = broker_url()
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
    found: set[str] = set()
    unacked: set[str] = set()
    try:
        # The queue's own lists, named, not found by a SCAN: a scan walks every key in the database (a lease
        # and a progress hash per running shard), so its cost grew with the fleet, not with the queues.
        for key, length in _list_lengths(client, queues).items():
            for start in range(0, length, SCAN_CHUNK):
                for raw in client.lrange(key, start, start + SCAN_CHUNK - 1):
                    found.update(_task_ids(raw))
        for _, raw in client.hscan_iter("unacked", count=SCAN_CHUNK):
            unacked.update(_task_ids(raw))
    except redis.RedisError as exc:
        logger.warning("cannot read the broker's queues: %s", exc)
        return None
    finally:
        client.close()
    return BrokerView(queued=found, unacked=unacked)


@dataclass(frozen=True)
class QueueDepth:
    ready: int
    """Messages waiting in the queue, over all of its priority lists."""
    reserved: int
    """Messages delivered to a worker and not yet acknowledged."""


def priority_lists(queue: str) -> list[str]:
    """The Redis lists that hold `queue`'s messages, one per priority step; `LLEN <queue>` alone misses the rest."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEPARATOR}{step}" for step in PRIORITY_STEPS]


def _list_lengths(client: redis.Redis, queues: Iterable[str]) -> dict[str, int]:
    """The length of every priority list of `queues`, in one pipelined round trip."""
    keys = [key for queue in queues for key in priority_lists(queue)]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.llen(key)
    return dict(zip(keys, pipe.execute(), strict=True))


def _routing_key(raw: bytes | str) -> str | None:
    try:
        entry: Any = json.loads(raw)
    except ValueError:
        return None
    # An unacked entry is [message, exchange, routing_key]; our queues are routed by their own name.
    if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], str):
        return entry[2]
    return None


def queue_depths(queues: Iterable[str], *, client: redis.Redis | None = None) -> dict[str, QueueDepth] | None:
    """Ready and reserved message counts per queue; None where the broker is not Redis or cannot be read.

    Costs one pipelined round trip of LLENs, plus a scan of the `unacked` hash, which holds at most
    the messages workers have prefetched (prefetch 1 per slot).
    """
    url = broker_url()
    names = sorted(set(queues))
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    own = client is None
    client = client or redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    try:
        lengths = _list_lengths(client, names)
        reserved = dict.fromkeys(names, 0)
        for _, raw in client.hscan_iter("unacked", count=SCAN_CHUNK):
            routed = _routing_key(raw)
            if routed in reserved:
                reserved[routed] += 1
    except redis.RedisError as exc:
        logger.warning("cannot read the broker's queue depths: %s", exc)
        return None
    finally:
        if own:
            client.close()
    return {
        queue: QueueDepth(ready=sum(lengths[key] for key in priority_lists(queue)), reserved=reserved[queue])
        for queue in names
    }
