"""Stop and pause flags: how a job tells its shards to stop, or not to start, without the database.

A shard checks its job's stop flag (cancelled, expired) when it arrives and between micro-batches,
and its pause flag only when it arrives: a paused job's running shards finish. If Redis loses a stop
flag, shards of an ended job run for nothing; the job's ending in the database does not change. The
reconciler raises the pause flags of paused jobs again on every sweep.
"""

from __future__ import annotations

import logging

import redis

from tasks.shared.config import RESULT_EXPIRES_S
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)


PAUSED = "paused"
"""The pause flag's value: why a shard arriving at a paused job does not start."""


def _key(job_id: str) -> str:
    return f"batchery:stop:{job_id}"


def _pause_key(job_id: str) -> str:
    return f"batchery:pause:{job_id}"


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


def request_pause(job_ids: list[str]) -> None:
    """Best effort, like the stop flag; the reconciler raises it again while the job is paused."""
    if not job_ids:
        return
    try:
        pipe = redis_client().pipeline(transaction=False)
        for job_id in job_ids:
            pipe.set(_pause_key(job_id), PAUSED, ex=RESULT_EXPIRES_S)
        pipe.execute()
    except redis.RedisError as exc:
        logger.warning("could not raise the pause flag of %d jobs: %s", len(job_ids), exc)


def clear_pause(job_id: str) -> None:
    try:
        redis_client().delete(_pause_key(job_id))
    except redis.RedisError as exc:
        logger.warning("could not clear the pause flag of job %s: %s", job_id, exc)


def arrival_flags(job_id: str) -> list[str]:
    """The keys a shard arriving reads, in order: its job's stop flag (the reason), then its pause flag
    (`PAUSED`); the first set is why it must not run (see `Lease.take_unless_flagged`)."""
    return [_key(job_id), _pause_key(job_id)]
