"""The throttles' counts (failed sign-ins, failed API keys) live in Redis and outlive a test: each
test that may fail a sign-in or a key starts from none."""

from __future__ import annotations

import redis

from tasks.shared.redis_client import redis_client


def throttle_counts_clear(url: str | None = None) -> None:
    """Forget every failed sign-in and API-key attempt counted (the "throttle" cache and key_throttle), in the
    Redis at `url` (a live stack's) or the one this process's environment names."""
    client = redis.Redis.from_url(url) if url else redis_client()
    for key in client.scan_iter(match="batchery:throttle*", count=1000):
        client.delete(key)
