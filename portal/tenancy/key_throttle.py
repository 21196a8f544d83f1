"""Failed API-key attempts, counted in Redis by client address and by the key's prefix.

Only failures count, and only failures are refused: a client over the limit gets 429 (with the
seconds left of its window) where it would have got 401, while a valid key from the same address
still authenticates. Every test client, and every client behind one NAT or proxy, shares an address:
refusing its good keys would let one tenant's bad script lock another tenant out.

Counts are fixed windows of BATCHERY_API_KEY_FAILURE_WINDOW_S shared by every portal process. A
Redis that does not answer turns the throttle off, never the key check (as the key cache does).
"""

from __future__ import annotations

import hashlib
import logging

import redis
from django.conf import settings

from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

COUNTER_KEY = "batchery:throttle:apikey:{kind}:{value}"


def _counter(kind: str, value: str) -> str:
    # Hashed: an attacker's header must not choose the Redis key's length or bytes.
    return COUNTER_KEY.format(kind=kind, value=hashlib.sha256(value.encode()).hexdigest()[:32])


def key_failure_note(*, address: str, prefix: str | None) -> int | None:
    """Count one failed attempt from `address` (on the key prefix it named, if any); the seconds the
    client must wait if this attempt is past the limit of either, else None."""
    counters = [_counter("address", address)]
    if prefix:
        counters.append(_counter("prefix", prefix))
    window = settings.BATCHERY_API_KEY_FAILURE_WINDOW_S
    try:
        pipe = redis_client().pipeline(transaction=False)
        for counter in counters:
            # The window starts with the first failure and is not extended by the next ones.
            pipe.set(counter, 0, ex=window, nx=True)
            pipe.incr(counter)
            pipe.ttl(counter)
        replies = pipe.execute()
    except redis.RedisError as exc:
        logger.warning("failed API-key attempts not counted: %s", exc)
        return None
    waits = [
        max(int(ttl), 1)
        for count, ttl in zip(replies[1::3], replies[2::3], strict=True)
        if int(count) > settings.BATCHERY_API_KEY_FAILURE_LIMIT
    ]
    return max(waits) if waits else None
