"""Leases: a Redis key with a short TTL that a running attempt keeps renewing.

The reconciler reads them to tell a shard that is being worked on from one whose message was lost.
A heartbeat thread renews the lease, so a long micro-batch does not let it lapse; a process that
dies (or is paused past the TTL) stops renewing, and its lease expires.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import TracebackType

import redis

from tasks.env import env_int
from tasks.redis_client import redis_client

logger = logging.getLogger(__name__)

LEASE_TTL_S = env_int("BATCHERY_LEASE_TTL_S", 30, minimum=2)


def shard_lease_key(job_id: str, shard_index: int) -> str:
    return f"batchery:lease:shard:{job_id}:{shard_index}"


def job_lease_key(kind: str, job_id: str) -> str:
    """Leases of a job's control steps (`plan`, `merge`)."""
    return f"batchery:lease:{kind}:{job_id}"


def lease_holder(key: str) -> str | None:
    """Who holds the lease, or None if nobody does; None too when Redis cannot be asked."""
    try:
        value = redis_client().get(key)
    except redis.RedisError:
        return None
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def lease_holders(keys: Sequence[str]) -> list[str | None]:
    """`lease_holder` of each key, in one round trip; all None when Redis cannot be asked."""
    if not keys:
        return []
    try:
        values = redis_client().mget(keys)
    except redis.RedisError:
        return [None] * len(keys)
    return [value.decode() if isinstance(value, bytes) else value for value in values]


class LeaseHeld(Exception):
    """An exclusive lease is held by someone else."""

    def __init__(self, key: str, holder: str | None) -> None:
        super().__init__(f"{key} is held by {holder}")
        self.holder = holder


class Lease:
    """Hold `key` while the block runs; renewed every third of the TTL by a daemon thread.

    An exclusive lease is taken only if nobody holds it (SET NX) and raises `LeaseHeld` otherwise;
    a plain one is simply written, for work that is fenced elsewhere (shard commits).
    """

    def __init__(self, key: str, holder: str, *, ttl_s: int = LEASE_TTL_S, exclusive: bool = False) -> None:
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self.exclusive = exclusive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"lease {key}", daemon=True)

    def _put(self) -> None:
        try:
            redis_client().set(self.key, self.holder, ex=self.ttl_s)
        except redis.RedisError as exc:
            # Without Redis the reconciler sees no lease and may send the work again; the fenced
            # commit makes that harmless, so the attempt goes on.
            logger.warning("could not renew lease %s: %s", self.key, exc)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._put()

    def __enter__(self) -> Lease:
        if self.exclusive:
            try:
                taken = redis_client().set(self.key, self.holder, ex=self.ttl_s, nx=True)
            except redis.RedisError as exc:
                logger.warning("could not take lease %s, going on without it: %s", self.key, exc)
                taken = True
            if not taken:
                raise LeaseHeld(self.key, lease_holder(self.key))
        else:
            self._put()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        try:
            redis_client().delete(self.key)
        except redis.RedisError:
            return
