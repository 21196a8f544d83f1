"""Models for benchmarks of the platform itself.

`SleepModel` sleeps a fixed time a record and echoes: a GPU's time is what the scheduler shares;
sleeping stands in for it without using a core, so that a two-core machine can simulate a fleet.
`sleep_per_record` is a run-time parameter (0: a no-op model, for measuring the platform's own cost
per shard). `ZeroEmbedModel` answers every record with the same 384-float embedding, computing
nothing: what a job through it costs is Batchery's own cost (see `bench.ceiling`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class SleepModel:
    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        seconds = float(params.get("sleep_per_record", 0.0)) * len(inputs)
        if seconds > 0:
            time.sleep(seconds)
        return [{"echo": value} for value in inputs]


def sleep_factory(*, spec: Any, device: str) -> SleepModel:
    return SleepModel()


EMBEDDING_SIZE = 384


class ZeroEmbedModel:
    def __init__(self) -> None:
        # float32, as a real embedding engine returns it, so the output goes the same serialization way.
        self.vector = np.linspace(-1.0, 1.0, EMBEDDING_SIZE, dtype=np.float32)

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [{"embedding": self.vector} for _ in inputs]


def zero_embed_factory(*, spec: Any, device: str) -> ZeroEmbedModel:
    return ZeroEmbedModel()
