"""PostgreSQL advisory locks that keep the control processes (one host or several) out of each other's
way where a row lock cannot: a queue's scheduler tick, a job's merge. Named by a string, hashed to the
lock's 64-bit key. On SQLite (the demo) there is one writer at a time anyway, and these lock nothing."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connection

logger = logging.getLogger(__name__)


def _key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), signed=True)


def lock_until_commit(name: str) -> None:
    """Wait for the lock `name` and hold it until the current transaction ends."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_key(name)])


def taken_until_commit(name: str) -> bool:
    """Take the lock `name` until the current transaction ends if nobody holds it; whether it was taken."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [_key(name)])
        (taken,) = cursor.fetchone()
    return bool(taken)


@contextmanager
def held_unless_taken(name: str) -> Iterator[bool]:
    """Take the lock `name` for the block if nobody holds it, without waiting: the block gets whether it
    holds it. Held by the session, not a transaction, so a long block needs none open; a process that
    dies lets go with its connection, as no Redis lease can promise after a Redis restart."""
    if connection.vendor != "postgresql":
        yield True
        return
    key = _key(name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        (taken,) = cursor.fetchone()
    try:
        yield bool(taken)
    finally:
        if taken:
            try:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
            except DatabaseError:
                # The block failed inside a transaction, or the connection is gone: the lock goes with the
                # connection, which Django closes as broken.
                logger.warning("could not let go of advisory lock %s; it ends with the connection", name)
