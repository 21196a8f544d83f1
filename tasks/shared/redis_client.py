"""The one Redis connection pool for Batchery's own keys (progress, leases, stop flags)."""

from __future__ import annotations

import functools

import redis

from tasks.shared.config import progress_redis_url


def redis_client() -> redis.Redis:
    """The client of the Redis the environment names now.

    Kept per URL, not once per process: a process pointed at another Redis (the stack's embedded
    one, a test's) gets that Redis's client from its next call, and never keeps one of a Redis gone."""
    return _client_for(progress_redis_url())


@functools.cache
def _client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
