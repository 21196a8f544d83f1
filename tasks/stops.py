"""Stop flags: how a cancelled or expired job tells its shards to stop, without the database.

A shard checks its job's flag when it arrives and between micro-batches. If Redis loses the flag,
shards of an ended job run for nothing; the job's ending in the database does not change.
"""

from __future__ import annotations

import redis

from tasks.config import RESULT_EXPIRES_S
from tasks.redis_client import redis_client


def _key(job_id: str) -> str:
    return f"batchery:stop:{job_id}"


def request_stop(job_id: str, reason: str) -> None:
    redis_client().set(_key(job_id), reason, ex=RESULT_EXPIRES_S)


def clear_stop(job_id: str) -> None:
    """A retried job runs again: its shards must not find the old flag."""
    redis_client().delete(_key(job_id))


def stop_reason(job_id: str) -> str | None:
    try:
        value = redis_client().get(_key(job_id))
    except redis.RedisError:
        return None
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
