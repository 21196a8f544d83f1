"""Shard endings gathered per GPU queue and settled in batches.

Each chord callback (`batchery.shard_done`) puts its shards' endings in the queue's inbox, a Redis
list, and then drains the inbox unless another callback is draining it already. The drainer takes
up to `DRAIN_BATCH` endings at a time and settles them together (`endings.endings_settle`). A lone
ending is settled at once; under load, the endings that arrive while one batch is settled make the
next batch (docs/architecture.md, Chords and waves).

The drainer looks at the inbox again after letting go of its lock, so an ending put there while it
was letting go is never stranded. Endings a failed batch took are put back before the error goes
up (`BatchNotSettled`), and the task retries while the database is down. A batch holds endings of
any of the queue's jobs, so its failure fails none of them, not even the job of the callback that
drained it: if a drainer gives up, or dies holding endings, their shards stay `dispatched` and the
next drain or the reconciler's sweep settles them (as it does for any lost callback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import redis
from django.db import InterfaceError, OperationalError

from portal.execution.endings import ShardEnding, endings_settle
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

INBOX_KEY = "batchery:shards-finished:{queue}"
DRAIN_LOCK_KEY = "batchery:shards-finished:{queue}:drain"
DRAIN_BATCH = 500
"""Endings settled in one go: enough to amortize a tick over a burst, few enough for one transaction."""
DRAIN_LOCK_TTL_S = 120
"""A drainer that died lets go after this; a live one settles a batch in far less."""


class BatchNotSettled(Exception):
    """Settling a batch of a queue's shard endings failed; the endings are back in its inbox."""

    fails_no_job = True
    """The batch held several jobs' endings: its control task fails none of them (`ControlTask.on_failure`);
    the reconciler's sweep settles whatever stays `dispatched`."""

    def __init__(self, queue: str, endings: int, transient: bool) -> None:
        # Positional, so that the exception pickles whole.
        super().__init__(queue, endings, transient)
        self.queue = queue
        self.endings = endings
        """How many endings the batch held."""
        self.transient = transient
        """The database failed: the batch may settle once it is back, so the task retries."""

    def __str__(self) -> str:
        return f"settling {self.endings} shard endings of {self.queue!r} failed"


def endings_report(*, job_id: str, shard_indexes: Sequence[int], queue: str = "") -> None:
    """The tasks of a job's shards ended (a chord's): settle them, with the other endings of their
    queue waiting to be settled."""
    # A chord naming several shards sent them as one wave message (`dispatch.shards_send`).
    in_wave = len(shard_indexes) > 1
    client = redis_client()
    try:
        client.rpush(
            INBOX_KEY.format(queue=queue), *(_item(ShardEnding(job_id, index, in_wave)) for index in shard_indexes)
        )
    except redis.RedisError:
        # Without Redis there is nobody to batch with: settle these alone. Their errors are this
        # job's own, so the task fails the job once its retries are spent, as before the inbox.
        endings_settle([ShardEnding(job_id, index, in_wave) for index in shard_indexes])
        return
    drain(client, queue)


def drain(client: redis.Redis, queue: str) -> int:
    """Settle the queue's inbox until it is empty or another drainer holds it; return the endings settled."""
    inbox = INBOX_KEY.format(queue=queue)
    settled = 0
    while True:
        lock = client.lock(DRAIN_LOCK_KEY.format(queue=queue), timeout=DRAIN_LOCK_TTL_S)
        if not lock.acquire(blocking=False):
            return settled  # the holder settles ours too: it looks again after letting go
        try:
            # One batch a hold of the lock: however long endings keep coming, the lock never outlives its TTL.
            if raw := cast("list[bytes] | None", client.lpop(inbox, DRAIN_BATCH)):
                endings = [_parse(item) for item in raw]
                try:
                    endings_settle(endings)
                except Exception as exc:
                    client.lpush(inbox, *reversed(raw))
                    transient = isinstance(exc, (OperationalError, InterfaceError))
                    raise BatchNotSettled(queue, len(endings), transient) from exc
                settled += len(endings)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                logger.warning("the settling lock of %s expired while held; batches may have overlapped", queue)
        if not client.llen(inbox):
            return settled


def _item(ending: ShardEnding) -> str:
    return f"{ending.job_id}:{ending.shard_index}:w" if ending.in_wave else f"{ending.job_id}:{ending.shard_index}"


def _parse(item: bytes) -> ShardEnding:
    job_id, index, *wave = item.decode().split(":")
    return ShardEnding(job_id, int(index), bool(wave))
