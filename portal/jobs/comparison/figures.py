"""Figures every task's comparison shares: a distribution's summary with its histogram, and the records
that changed most."""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = {"p1": 1, "p5": 5, "p25": 25, "median": 50, "p75": 75, "p95": 95}


def distribution(values: Sequence[float] | array[float] | np.ndarray, *, edges: Sequence[float]) -> dict[str, Any]:
    """`values` summarised: `count`, `min`, `p1`, `p5`, `p25`, `median`, `mean`, `p75`, `p95`, `max` (numpy's
    linear-interpolation percentiles; null without values) and `histogram`: `edges` and the `counts` of the
    values between each two (numpy's `histogram`: each bin holds its left edge, the last its right one too)."""
    array = np.asarray(values, dtype=np.float64)
    counts, _ = np.histogram(array, bins=np.asarray(edges, dtype=np.float64))
    summary: dict[str, Any] = {"count": int(array.size)}
    if array.size:
        summary.update(min=float(array.min()), max=float(array.max()), mean=float(array.mean()))
        summary.update({name: float(np.percentile(array, q)) for name, q in PERCENTILES.items()})
    else:
        summary.update(dict.fromkeys(["min", "max", "mean", *PERCENTILES], None))
    summary["histogram"] = {"edges": [float(edge) for edge in edges], "counts": [int(count) for count in counts]}
    return summary


class MostChanged:
    """The `size` records of the highest score seen, kept in a heap: memory holds `size` entries whatever
    the record count. Ties go to the record seen first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._heap: list[tuple[float, int, dict[str, Any]]] = []
        self._seen = 0

    def offer(self, score: float, entry: dict[str, Any]) -> None:
        # The heap's smallest is the one to drop; a later record of an equal score ranks below an earlier one.
        self._seen += 1
        item = (score, -self._seen, entry)
        if len(self._heap) < self.size:
            heapq.heappush(self._heap, item)
        elif item[:2] > self._heap[0][:2]:
            heapq.heapreplace(self._heap, item)

    def entries(self) -> list[dict[str, Any]]:
        """The kept records, the highest score first."""
        return [entry for _, _, entry in sorted(self._heap, key=lambda item: item[:2], reverse=True)]
