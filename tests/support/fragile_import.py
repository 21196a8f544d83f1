"""A module that, like torch, registers itself when imported and fails a second registration.

An import interrupted half-way (by a soft time limit) leaves the registration behind, so any later
import in the same process fails: the process must be replaced, not reused. The first import in a
test is slow (while the file named by CHAOS_FIRST_IMPORT_MARKER does not exist yet), so that the
shard's soft time limit strikes inside it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.support.chaos_engines import FRAGILE_REGISTRY

if "fragile_op" in FRAGILE_REGISTRY:
    raise RuntimeError("duplicate registration of fragile_op: this process imported the module half-way before")
FRAGILE_REGISTRY.add("fragile_op")

_marker = Path(os.environ["CHAOS_FIRST_IMPORT_MARKER"])
if not _marker.exists():
    _marker.touch()
    time.sleep(60)
