"""Engines for the micro-batch loop's tests: they echo their inputs, and fail where a test asks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class EchoEngine:
    """Answers ``{"echo": value}`` per input and raises on any batch that holds a value in ``bad``."""

    def __init__(self, bad: frozenset[Any] = frozenset()) -> None:
        self.bad = bad
        self.batches: list[list[Any]] = []

    def load(self, *, device: str) -> None:
        pass

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.batches.append(list(inputs))
        for value in inputs:
            if value in self.bad:
                raise ValueError(f"cannot handle {value!r}")
        return [{"echo": value} for value in inputs]

    def memory_bytes(self) -> int:
        return 0

    def unload(self) -> None:
        pass


class MemoryHungryEngine(EchoEngine):
    """Runs out of memory on a batch of more than ``fits`` records, or on any batch that holds ``"huge"``."""

    def __init__(
        self, *, fits: int, bad: frozenset[Any] = frozenset(), exc_type: type[Exception] = MemoryError
    ) -> None:
        super().__init__(bad)
        self.fits = fits
        self.exc_type = exc_type

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        if len(inputs) > self.fits or "huge" in inputs:
            self.batches.append(list(inputs))
            raise self.exc_type(f"cannot fit {len(inputs)} records")
        return super().run_batch(inputs, params)


def items_of(*values: Any) -> list[tuple[str, Any]]:
    return [(f"id-{index}", value) for index, value in enumerate(values)]
