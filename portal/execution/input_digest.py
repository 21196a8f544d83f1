"""The digest of a job's input as stored (its compressed bytes, where it is compressed): what its
manifest names it by, so that a file can be checked against the job that read it (`sha256sum`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from tasks.shared.storage import input_open

BLOCK_BYTES = 1024 * 1024
BEAT_BLOCKS = 64
"""A planner reading a large input beats its heartbeat every this many blocks, as it does every few records."""


def input_digest(uri: str, *, beat: Callable[[], None]) -> str:
    """``sha256:`` and the hex digest of the input's bytes, read once more in order; `beat` is called as the
    reading goes on (a planner's heartbeat, which raises once the job stops planning)."""
    digest = hashlib.sha256()
    with input_open(uri) as stream:
        blocks = 0
        while block := stream.read(BLOCK_BYTES):
            digest.update(block)
            blocks += 1
            if blocks % BEAT_BLOCKS == 0:
                beat()
    return "sha256:" + digest.hexdigest()
