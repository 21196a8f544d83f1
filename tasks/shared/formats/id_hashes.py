"""The 64-bit hashes of an input's custom_ids, kept in bounded memory to find repeated ones.

Up to `BUFFER_HASHES` hashes stay in memory. Past that the buffer is sorted and spilled into
`BUCKETS` files by the hashes' top bits, so that at the end each bucket, a small slice of the
whole, is loaded and sorted on its own: memory stays near the buffer's size however large the
input (a 2 GB input of 8 million records holds about 8 MB, not 130 MB).
"""

from __future__ import annotations

import shutil
import tempfile
from array import array
from pathlib import Path

import numpy as np

BUFFER_HASHES = 1 << 20
"""Hashes held in memory before a spill (8 MiB)."""
BUCKET_BITS = 8
BUCKETS = 1 << BUCKET_BITS
"""Spill files, chosen by a hash's top bits; 256 keep each under 8 MiB up to 268 million records."""


class IdHashes:
    """Append hashes while reading an input, then ask which ones occur more than once."""

    def __init__(self, *, buffer_hashes: int = BUFFER_HASHES) -> None:
        self._buffer: array[int] = array("Q")
        self._buffer_hashes = buffer_hashes
        self._spilled: Path | None = None
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, value: int) -> None:
        self._buffer.append(value)
        self._count += 1
        if len(self._buffer) >= self._buffer_hashes:
            self._spill()

    def _spill(self) -> None:
        if self._spilled is None:
            self._spilled = Path(tempfile.mkdtemp(prefix="batchery-id-hashes-"))
        ordered = np.sort(np.frombuffer(self._buffer, dtype=np.uint64))
        # Sorted values are grouped by their top bits: each bucket's run is one contiguous slice.
        edges = np.searchsorted(ordered, np.arange(1, BUCKETS, dtype=np.uint64) << np.uint64(64 - BUCKET_BITS))
        for bucket, run in enumerate(np.split(ordered, edges)):
            if run.size:
                with (self._spilled / f"{bucket:03d}").open("ab") as handle:
                    handle.write(run.tobytes())
        self._buffer = array("Q")

    def repeated(self) -> set[int]:
        """Hashes that occur twice or more; removes the spill files."""
        if self._spilled is None:
            return _repeats(np.frombuffer(self._buffer, dtype=np.uint64))
        if self._buffer:
            self._spill()
        found: set[int] = set()
        try:
            for path in sorted(self._spilled.iterdir()):
                found |= _repeats(np.fromfile(path, dtype=np.uint64))
        finally:
            shutil.rmtree(self._spilled, ignore_errors=True)
            self._spilled = None
        return found

    def __del__(self) -> None:
        if self._spilled is not None:
            shutil.rmtree(self._spilled, ignore_errors=True)


def _repeats(hashes: np.ndarray) -> set[int]:
    if hashes.size < 2:
        return set()
    ordered = np.sort(hashes)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return {int(value) for value in np.unique(repeated)}
