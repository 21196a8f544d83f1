"""Digests of JSON values, the same on both sides: equal values (whatever their keys' order) have equal digests."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_digest(value: Any) -> str:
    """``sha256:`` and the hex digest of the value as canonical JSON (sorted keys, no spaces, UTF-8)."""
    encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(encoded).hexdigest()
