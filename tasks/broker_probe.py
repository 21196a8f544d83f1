"""What messages the broker holds: queued or delivered-but-unacknowledged task ids.

The reconciler uses it to tell a lost shard message from one that is merely waiting in a queue.
Kombu's Redis transport keeps each queue as a list (one list per priority step) and delivered
messages in the `unacked` hash; both hold the task id in the message headers. For any other broker
the answer is None ("cannot tell"), and the reconciler falls back to waiting out the visibility
timeout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from tasks.config import broker_url

logger = logging.getLogger(__name__)

PRIORITY_SEPARATOR = "\x06\x16"
SCAN_CHUNK = 1000


def _task_id(raw: bytes | str) -> str | None:
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        return None
    if isinstance(payload, list):  # unacked entries are [message, exchange, routing_key]
        payload = payload[0] if payload else {}
    if not isinstance(payload, dict):
        return None
    headers = payload.get("headers") or {}
    task_id = headers.get("id")
    return str(task_id) if task_id else None


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
        for queue in queues:
            for key in client.scan_iter(match=f"{queue}*", count=SCAN_CHUNK):
                name = key.decode() if isinstance(key, bytes) else key
                if name != queue and not name.startswith(queue + PRIORITY_SEPARATOR):
                    continue
                if client.type(key) not in (b"list", "list"):
                    continue
                length = client.llen(key)
                for start in range(0, length, SCAN_CHUNK):
                    for raw in client.lrange(key, start, start + SCAN_CHUNK - 1):
                        task_id = _task_id(raw)
                        if task_id:
                            found.add(task_id)
        for _, raw in client.hscan_iter("unacked", count=SCAN_CHUNK):
            task_id = _task_id(raw)
            if task_id:
                unacked.add(task_id)
    except redis.RedisError as exc:
        logger.warning("cannot read the broker's queues: %s", exc)
        return None
    finally:
        client.close()
    return BrokerView(queued=found, unacked=unacked)
