"""Live progress counters in Redis: one hash per job, one field per shard.

Each shard overwrites its own field with its running totals, so a redelivered shard replaces its
numbers instead of adding to them. Redis only holds these live figures; the database stays the truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.client import Pipeline

from tasks.shared.config import RESULT_EXPIRES_S
from tasks.shared.redis_client import redis_client as _client


def _key(job_id: str) -> str:
    return f"batchery:progress:{job_id}"


@dataclass(frozen=True)
class Progress:
    done: int
    """Records finished (succeeded or failed) by running or finished shards."""
    failed: int


def shard_progress_commands(pipe: Pipeline, job_id: str, shard_index: int, *, done: int, failed: int) -> None:
    """Add the writing of a shard's figures to `pipe`, to be sent with other commands in one round trip."""
    pipe.hset(_key(job_id), str(shard_index), f"{done},{failed}")
    pipe.expire(_key(job_id), RESULT_EXPIRES_S)


def publish_shard_progress(job_id: str, shard_index: int, *, done: int, failed: int) -> bool:
    """Best effort, True if written: progress is for people watching; a Redis hiccup must not fail the shard."""
    try:
        pipe = _client().pipeline(transaction=False)
        shard_progress_commands(pipe, job_id, shard_index, done=done, failed=failed)
        pipe.execute()
    except redis.RedisError:
        return False
    return True


def read_shard_progress(job_id: str) -> dict[int, Progress]:
    """Each running or finished shard's live figures, by shard index; empty if Redis cannot be read."""
    try:
        fields = _client().hgetall(_key(job_id))
    except redis.RedisError:
        return {}
    return _parse(fields)


def _parse(fields: dict[bytes | str, bytes | str]) -> dict[int, Progress]:
    shards = {}
    for index, value in fields.items():
        done, failed = (value.decode() if isinstance(value, bytes) else value).split(",")
        shards[int(index)] = Progress(done=int(done), failed=int(failed))
    return shards


def _total(shards: dict[int, Progress]) -> Progress:
    return Progress(
        done=sum(shard.done for shard in shards.values()), failed=sum(shard.failed for shard in shards.values())
    )


def read_job_progress(job_id: str) -> Progress:
    return _total(read_shard_progress(job_id))


def read_jobs_progress(job_ids: Sequence[str]) -> dict[str, Progress]:
    """`read_job_progress` of several jobs in one round trip (a page of a job list); zeros if Redis cannot be read."""
    if not job_ids:
        return {}
    try:
        pipe = _client().pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(_key(job_id))
        hashes = pipe.execute()
    except redis.RedisError:
        hashes = [{}] * len(job_ids)
    return {job_id: _total(_parse(fields)) for job_id, fields in zip(job_ids, hashes, strict=True)}
