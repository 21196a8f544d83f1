"""Figures of a classification re-run: the confusion between each record's old and new label, and how
often they agree. A response's label is its `label` (the likeliest of its `scores`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from portal.jobs.comparison.pairs import Pair


class LabelComparison:
    """Takes the records that succeeded on both sides (`add`); memory: a count per pair of labels."""

    def __init__(self) -> None:
        self._pairs = Counter[tuple[str, str]]()

    def add(self, pair: Pair) -> None:
        old, new = pair.old["response"].get("label"), pair.new["response"].get("label")
        self._pairs[(str(old), str(new))] += 1

    def figures(self) -> dict[str, Any]:
        """`labels` (every label seen, sorted), `confusion` (`{old label: {new label: records}}`, every label
        of `labels` on both axes) and `agreement_rate` (records whose label stayed, of those compared)."""
        labels = sorted({label for pair in self._pairs for label in pair})
        confusion = {old: {new: self._pairs[(old, new)] for new in labels} for old in labels}
        total = sum(self._pairs.values())
        agreed = sum(self._pairs[(label, label)] for label in labels)
        return {"labels": labels, "confusion": confusion, "agreement_rate": agreed / total if total else None}
