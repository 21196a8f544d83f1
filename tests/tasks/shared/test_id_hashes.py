"""Repeated custom_id hashes are found the same way in memory and spilled to disk."""

from __future__ import annotations

import numpy as np

from tasks.shared.formats.id_hashes import IdHashes


def test_repeats_are_found_whether_or_not_the_hashes_spilled_to_disk() -> None:
    rng = np.random.default_rng(7)
    values = rng.integers(0, 2**64, size=50_000, dtype=np.uint64).tolist()
    repeated = {values[10], values[30_000], values[49_999]}
    stream = [*values, values[10], values[30_000], values[49_999], values[30_000]]
    for buffer_hashes in (1_000_000, 4_096):
        hashes = IdHashes(buffer_hashes=buffer_hashes)
        for value in stream:
            hashes.append(value)
        assert len(hashes) == len(stream)
        assert hashes.repeated() == repeated


def test_spilling_keeps_memory_to_the_buffer_and_cleans_up() -> None:
    hashes = IdHashes(buffer_hashes=1_000)
    for value in range(10_500):
        hashes.append(value * 0x9E3779B97F4A7C15 % 2**64)
    assert len(hashes._buffer) == 500
    spilled = hashes._spilled
    assert spilled is not None and any(spilled.iterdir())
    assert hashes.repeated() == set()
    assert not spilled.exists()
