"""Shard specs for tests of what a slot does with a shard's message, without an input or a job behind it."""

from __future__ import annotations

from typing import Any

from gpuworkers.spec import ModelSpec
from tasks.shared.specs import ShardSpec


def message_spec(model: ModelSpec, **fields: Any) -> ShardSpec:
    """A one-record shard of `model` reading `prompt`, with `fields` (params, adapters, ...) over that."""
    base: dict[str, Any] = {
        "job_id": "j",
        "shard_index": 0,
        "record_count": 1,
        "input_uri": "",
        "shard_prefix": "",
        "model": model,
        "input_field": "prompt",
    }
    return ShardSpec(**{**base, **fields})
