"""The one Redis connection pool for Batchery's own keys (progress, leases, stop flags)."""

from __future__ import annotations

import functools

import redis

from tasks.config import progress_redis_url


@functools.cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(progress_redis_url(), socket_timeout=5, socket_connect_timeout=5)
