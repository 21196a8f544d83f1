"""Shared locks that keep a cache entry on disk while a process of this host has its model loaded.

Each entry has an "in use" file. A process that resolves the entry holds ``flock(LOCK_SH)`` on it
until the model is unloaded; the evictor takes ``LOCK_EX | LOCK_NB`` and skips the entry when that
fails. flock locks belong to the open file, so they also guard against the evictor in the same
process, and the kernel drops them when a process dies: a crashed slot never pins an entry.

The warm model cache (`gpuworkers.cache`) opens a `load_scope` around each engine load; holds taken
inside it are released when that engine is evicted. A hold taken outside any scope (a tool that
only reads a tokenizer) lasts as long as its process.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path


class EntryHold:
    """A shared lock on one entry's "in use" file, held until `release`."""

    def __init__(self, in_use_file: Path) -> None:
        fd = os.open(in_use_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            # Blocks only while an evictor holds the entry, which takes a moment and never waits itself.
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextmanager
def exclusive_if_unused(in_use_file: Path) -> Iterator[bool]:
    """Yields True with the entry locked against new holds when nobody holds it, else False."""
    fd = os.open(in_use_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


@dataclass
class LoadScope:
    """The holds taken while one model loads; released together when the model is unloaded."""

    model: str
    """Catalog name of the model being loaded, for the metrics' ``model`` label."""
    holds: list[EntryHold] = field(default_factory=list)
    resolved: dict[str, Path] = field(default_factory=dict)
    """Each ``s3://`` source resolved during the load -> the cache directory it was resolved to: what the
    model's files are digested from (`gpuworkers.weights.digest`) without listing the bucket again."""

    def release(self) -> None:
        while self.holds:
            self.holds.pop().release()


_current: ContextVar[LoadScope | None] = ContextVar("batchery_weights_load_scope", default=None)
_process_lifetime: list[EntryHold] = []


@contextmanager
def load_scope(model: str) -> Iterator[LoadScope]:
    """Collect the holds taken while ``model`` loads; the caller releases them on unload."""
    scope = LoadScope(model=model)
    token = _current.set(scope)
    try:
        yield scope
    finally:
        _current.reset(token)


def keep(hold: EntryHold, *, source: str, path: Path) -> None:
    """Give ``hold`` (of ``source``'s cache directory, ``path``) to the load in progress, or to the process
    when there is none."""
    scope = _current.get()
    (scope.holds if scope is not None else _process_lifetime).append(hold)
    if scope is not None:
        scope.resolved[source] = path


def current_model() -> str:
    """The model whose load is in progress in this context; empty outside a load."""
    scope = _current.get()
    return scope.model if scope is not None else ""
