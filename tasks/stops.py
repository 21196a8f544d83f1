"""Stop flags: how a cancelled or expired job tells its shards to stop, without the database.

A shard checks its job's flag when it arrives and between micro-batches. If Redis loses the flag,
shards of an ended job run for nothing; the job's ending in the database does not change.
"""

from __future__ import annotations

import logging

import redis

from tasks.config import RESULT_EXPIRES_S
from tasks.redis_client import redis_client

logger = logging.getLogger(__name__)


def _key(job_id: str) -> str:
    return f"batchery:stop:{job_id}"


def request_stop(job_id: str, reason: str) -> None:
    """Best effort: without Redis the job still ends; its shards just run to no purpose."""
    try:
        redis_client().set(_key(job_id), reason, ex=RESULT_EXPIRES_S)
    except redis.RedisError as exc:
        logger.warning("could not raise the stop flag of job %s: %s", job_id, exc)


def clear_stop(job_id: str) -> None:
    """A retried job runs again: its shards must not find the old flag."""
    try:
        redis_client().delete(_key(job_id))
    except redis.RedisError as exc:
        logger.warning("could not clear the stop flag of job %s: %s", job_id, exc)


def stop_reason(job_id: str) -> str | None:
    try:
        value = redis_client().get(_key(job_id))
    except redis.RedisError:
        return None
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
