"""A model for benchmarks of the platform itself: it sleeps a fixed time a record and echoes.

A GPU's time is what the scheduler shares; sleeping stands in for it without using a core, so that
a two-core machine can simulate a fleet. `sleep_per_record` is a run-time parameter (0: a no-op
model, for measuring the platform's own cost per shard).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any


class SleepModel:
    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        seconds = float(params.get("sleep_per_record", 0.0)) * len(inputs)
        if seconds > 0:
            time.sleep(seconds)
        return [{"echo": value} for value in inputs]


def sleep_factory(*, spec: Any, device: str) -> SleepModel:
    return SleepModel()
