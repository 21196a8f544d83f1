"""Leases: a Redis key with a short TTL that a running attempt keeps renewing.

The reconciler reads them to tell a shard that is being worked on from one whose message was lost.
One thread per process renews its leases, so a long micro-batch does not let it lapse; a process that
dies (or is paused past the TTL) stops renewing, and its lease expires.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import redis
from redis.client import Pipeline
from redis.commands.core import Script

from tasks.shared.config import LEASE_TTL_S
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)


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


class _Renewer:
    """One daemon thread per process that renews every lease it holds, each a third of its TTL after
    it was last written: a thread started and joined per lease would cost a short shard more than the
    lease's two Redis commands; here taking and letting go of a lease is a dictionary entry.

    Renewals are written under the lock, so a lease let go of (`remove`) is never written again
    after its holder deletes it."""

    def __init__(self) -> None:
        self._due: dict[Lease, float] = {}
        self._wake_at = math.inf
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        due = time.monotonic() + lease.ttl_s / 3
        with self._changed:
            self._due[lease] = due
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease renewer", daemon=True)
                self._thread.start()
            if due < self._wake_at:
                self._changed.notify()

    def remove(self, lease: Lease) -> None:
        with self._changed:
            self._due.pop(lease, None)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for lease, due in list(self._due.items()):
                    if due <= now:
                        try:
                            lease.put()
                        except Exception:  # one lease's failure must not end the renewals of all the others
                            logger.exception("renewing lease %s failed", lease.key)
                        self._due[lease] = now + lease.ttl_s / 3
                self._wake_at = min(self._due.values(), default=math.inf)
                self._changed.wait(None if self._wake_at == math.inf else self._wake_at - now)


_renewer = _Renewer()


def _renewer_after_fork() -> None:
    # A forked child has none of its parent's threads: it starts its own renewer when it takes a lease.
    global _renewer
    _renewer = _Renewer()


os.register_at_fork(after_in_child=_renewer_after_fork)


# The first of KEYS[2..] that holds a value, or else KEYS[1] written with ARGV[1] for ARGV[2] seconds.
_TAKE_UNLESS_FLAGGED = """
for index = 2, #KEYS do
    local flag = redis.call('GET', KEYS[index])
    if flag then return flag end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""


class Lease:
    """Hold `key` while the block runs; renewed every third of the TTL by the process's renewer thread.

    An exclusive lease is taken only if nobody holds it (SET NX) and raises `LeaseHeld` otherwise;
    a plain one is simply written, for work that is fenced elsewhere (shard commits), or written
    before the block by `take_unless_flagged`.
    """

    def __init__(self, key: str, holder: str, *, ttl_s: int = LEASE_TTL_S, exclusive: bool = False) -> None:
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self.exclusive = exclusive
        self._written = False
        self._sent_on_release: list[Callable[[Pipeline], None]] = []

    def take_unless_flagged(self, flags: Sequence[str]) -> str | None:
        """Write this plain lease unless one of the `flags` keys holds a value, in one round trip (a
        one-record shard paid one for reading its job's stop flags and another for its lease): the first
        flag's value, the lease not written, or None, the lease written and renewed from the block on.
        Without Redis, None: the work goes on without a lease, as when the lease cannot be written."""
        assert not self.exclusive, "an exclusive lease is taken by entering its block"
        try:
            flag = _take_unless_flagged_script()(keys=[self.key, *flags], args=[self.holder, self.ttl_s])
        except redis.RedisError as exc:
            logger.warning("could not read the flags %s or take lease %s: %s", ", ".join(flags), self.key, exc)
            return None
        if flag is not None:
            return flag.decode() if isinstance(flag, bytes) else str(flag)
        self._written = True
        return None

    def send_on_release(self, commands: Callable[[Pipeline], None]) -> None:
        """Have `commands` (which add to a pipeline) sent in the same round trip as the lease's deletion
        when its block ends: a short shard's last progress figures cost no round trip of their own."""
        self._sent_on_release.append(commands)

    def put(self) -> None:
        try:
            redis_client().set(self.key, self.holder, ex=self.ttl_s)
        except redis.RedisError as exc:
            # Without Redis the reconciler sees no lease and may send the work again; the fenced
            # commit makes that harmless, so the attempt goes on.
            logger.warning("could not renew lease %s: %s", self.key, exc)

    def __enter__(self) -> Lease:
        if self.exclusive:
            try:
                taken = redis_client().set(self.key, self.holder, ex=self.ttl_s, nx=True)
            except redis.RedisError as exc:
                logger.warning("could not take lease %s, going on without it: %s", self.key, exc)
                taken = True
            if not taken:
                raise LeaseHeld(self.key, lease_holder(self.key))
        elif not self._written:
            self.put()
        _renewer.add(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _renewer.remove(self)
        self._written = False
        sent, self._sent_on_release = self._sent_on_release, []
        try:
            pipe = redis_client().pipeline(transaction=False)
            for commands in sent:
                commands(pipe)
            pipe.delete(self.key)
            pipe.execute()
        except redis.RedisError:
            return


def _take_unless_flagged_script() -> Script:
    """The script, registered with the client of the Redis named now; redis-py loads it again where
    that Redis lost it (a restart)."""
    return _script_for(redis_client())


@functools.cache
def _script_for(client: redis.Redis) -> Script:
    return client.register_script(_TAKE_UNLESS_FLAGGED)
