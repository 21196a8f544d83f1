"""The throttles' counts (failed sign-ins, failed API keys) live in Redis and outlive a test: each
test that may fail a sign-in or a key starts from none."""

from __future__ import annotations

from tasks.shared.redis_client import redis_client


def throttle_counts_clear() -> None:
    """Forget every failed sign-in and API-key attempt counted (the "throttle" cache and key_throttle)."""
    client = redis_client()
    for key in client.scan_iter(match="batchery:throttle*", count=1000):
        client.delete(key)
