"""The host's on-disk cache of model directories: one entry per listing digest, within a byte budget.

Layout under the cache directory (the same filesystem throughout, so renames are atomic)::

    entries/<digest>/        the model directory a loader reads
    entries/<digest>.ready   the marker: written last, JSON with the entry's size; its mtime is the last use
    tmp/<digest>.<random>/   downloads in progress, and entries being deleted
    locks/<digest>.download  held (filelock) by the one process downloading or deleting the entry
    locks/<digest>.inuse     held shared by every process that has the entry's model loaded (`holds`)

An entry without its marker is partial. Partial entries and temporary directories whose download
lock is free belong to a process that died; `sweep` removes them when a process opens the cache,
and a download removes its own entry's leftovers before starting. Lock files are never deleted:
deleting a lock file that another process has open would let two processes both think they hold it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from gpuworkers import metrics
from gpuworkers.weights.holds import EntryHold, exclusive_if_unused

logger = logging.getLogger(__name__)

MARKER_SUFFIX = ".ready"


@dataclass(frozen=True)
class CachedEntry:
    """An entry ready on disk, held for the caller."""

    path: Path
    """The model directory."""
    hold: EntryHold
    """Keeps the entry from eviction; the caller releases it when the model is unloaded."""
    downloaded: bool
    """True when this call filled the entry; False when it was there already (or another process filled it)."""


class WeightStore:
    """The cache directory of one host; any number of processes may use it at once."""

    def __init__(self, root: Path, *, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self._entries = root / "entries"
        self._tmp = root / "tmp"
        self._locks = root / "locks"
        for directory in (self._entries, self._tmp, self._locks):
            directory.mkdir(parents=True, exist_ok=True)
        self.sweep()

    def open_entry(self, digest: str, *, size: int, fill: Callable[[Path], None], source: str) -> CachedEntry:
        """The entry ``digest``, filled by ``fill(staging_dir)`` unless it is ready; held for the caller.

        One process fills an entry at a time; the others wait on its download lock and then find it ready.
        """
        # Held from the first look, so the entry cannot be evicted between being found and being loaded.
        hold = EntryHold(self._locks / f"{digest}.inuse")
        try:
            if self._touch(digest):
                return CachedEntry(self._entries / digest, hold, downloaded=False)
            with self._download_lock(digest, wait=True):
                if self._touch(digest):
                    return CachedEntry(self._entries / digest, hold, downloaded=False)
                self._remove_partial(digest)
                self._make_room(size, keep=digest)
                staging = Path(tempfile.mkdtemp(prefix=f"{digest}.", dir=self._tmp))
                try:
                    fill(staging)
                    os.rename(staging, self._entries / digest)
                except BaseException:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
                self._write_marker(digest, {"source": source, "bytes": size})
                return CachedEntry(self._entries / digest, hold, downloaded=True)
        except BaseException:
            hold.release()
            raise

    def held_bytes(self) -> int:
        """Bytes of the entries ready on disk, as their markers record them."""
        return sum(size for _, size in self._ready_entries())

    def sweep(self) -> int:
        """Remove partial downloads and entries that no live process is working on; return how many."""
        removed = 0
        for path in [*self._tmp.iterdir(), *(p for p in self._entries.iterdir() if p.is_dir())]:
            digest = path.name.partition(".")[0]
            if path.parent == self._entries and self._marker(digest).exists():
                continue
            with self._download_lock(digest, wait=False) as locked:
                if locked and path.exists():
                    _remove(path)
                    removed += 1
        if removed:
            logger.info("removed %d partial model downloads from %s", removed, self.root)
        return removed

    def _marker(self, digest: str) -> Path:
        return self._entries / f"{digest}{MARKER_SUFFIX}"

    def _touch(self, digest: str) -> bool:
        """Record a use of the entry; False when it is not ready."""
        try:
            os.utime(self._marker(digest))
        except FileNotFoundError:
            return False
        return True

    def _write_marker(self, digest: str, content: dict[str, object]) -> None:
        staging = self._tmp / f"{digest}{MARKER_SUFFIX}"
        with staging.open("w") as handle:
            json.dump(content, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, self._marker(digest))

    def _remove_partial(self, digest: str) -> None:
        # Called with the entry's download lock held, so whatever is here was left by a process that died.
        for leftover in self._tmp.glob(f"{digest}.*"):
            _remove(leftover)
        _remove(self._entries / digest)

    def _ready_entries(self) -> list[tuple[Path, int]]:
        """(marker, bytes) of every ready entry, least recently used first."""
        found = []
        for marker in self._entries.glob(f"*{MARKER_SUFFIX}"):
            try:
                found.append((marker.stat().st_mtime, marker, int(json.loads(marker.read_text())["bytes"])))
            except (FileNotFoundError, ValueError, KeyError):
                continue  # evicted meanwhile, or a marker this version cannot read: not counted
        return [(marker, size) for _, marker, size in sorted(found)]

    def _make_room(self, needed: int, *, keep: str) -> None:
        # Counts ready entries only: two different models downloading at once may overshoot the
        # budget until the next download trims it, a fair price for not locking the whole cache.
        entries = self._ready_entries()
        held = sum(size for _, size in entries)
        for marker, size in entries:
            if held + needed <= self.budget_bytes:
                return
            digest = marker.name.removesuffix(MARKER_SUFFIX)
            if digest != keep and self._evict(digest):
                held -= size
        if held + needed > self.budget_bytes:
            # The model must load all the same; what is in use now is evicted once it is unloaded.
            logger.warning(
                "model cache %s will hold %d bytes, over its budget of %d: the rest is in use",
                self.root, held + needed, self.budget_bytes,
            )  # fmt: skip

    def _evict(self, digest: str) -> bool:
        with (
            self._download_lock(digest, wait=False) as locked,
            exclusive_if_unused(self._locks / f"{digest}.inuse") as unused,
        ):
            if not (locked and unused):
                return False
            # The marker goes first: from then on the entry is partial, never read as whole while it goes.
            self._marker(digest).unlink(missing_ok=True)
            # Renamed aside at once, deleted after: a crash mid-delete leaves a temporary directory to sweep.
            doomed = Path(tempfile.mkdtemp(prefix=f"{digest}.", dir=self._tmp))
            if (self._entries / digest).exists():
                os.rename(self._entries / digest, doomed / "entry")
        _remove(doomed)
        metrics.WEIGHTS_CACHE_EVICTIONS.labels(*metrics.slot_labels()).inc()
        logger.info("evicted model weights %s from %s", digest, self.root)
        return True

    @contextmanager
    def _download_lock(self, digest: str, *, wait: bool) -> Iterator[bool]:
        lock = FileLock(self._locks / f"{digest}.download", timeout=-1 if wait else 0)
        try:
            lock.acquire()
        except Timeout:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()


def _remove(path: Path) -> None:
    """Delete a file or a directory tree; already gone is fine (another process may sweep too)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
