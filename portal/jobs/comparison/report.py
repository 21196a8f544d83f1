"""The comparison report: both outputs read once, side by side, into the figures of the job's task.

Every task's report counts how the records' endings changed (`records`: compared, both succeeded,
`ok_to_error`, `error_to_ok`, both failed); the records that succeeded on both sides give the task's
figures (`embed.py`, `text.py`, `classify.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from portal.jobs.comparison.classify import LabelComparison
from portal.jobs.comparison.embed import EmbeddingComparison
from portal.jobs.comparison.pairs import Pair, output_pairs
from portal.jobs.comparison.text import TextComparison

MOST_CHANGED = 20
"""Records listed as those that changed most."""
NEIGHBOURS_K = 10
"""Neighbours compared a sampled record (overlap@10)."""


@dataclass(frozen=True)
class ComparisonLimits:
    """What a report may cost."""

    neighbour_sample: int
    """Records whose nearest neighbours are compared (embeddings)."""
    max_vector_bytes: int
    """Memory for the vectors the neighbours are searched among (embeddings)."""
    max_text_chars: int = 4_000
    """Characters of each text the edit distance is measured on (generations): its cost is their product."""


class _TaskFigures(Protocol):
    def add(self, pair: Pair) -> None: ...

    def figures(self) -> dict[str, Any]: ...


def _figures_for(task: str, *, records: int, limits: ComparisonLimits) -> tuple[str, _TaskFigures]:
    if task == "embed":
        return "embeddings", EmbeddingComparison(
            records=records,
            most_changed=MOST_CHANGED,
            sample=limits.neighbour_sample,
            k=NEIGHBOURS_K,
            max_vector_bytes=limits.max_vector_bytes,
        )
    if task == "classify":
        return "classification", LabelComparison()
    return "text", TextComparison(most_changed=MOST_CHANGED, max_chars=limits.max_text_chars)


def compare_outputs(*, old_uri: str, new_uri: str, task: str, records: int, limits: ComparisonLimits) -> dict[str, Any]:
    """The report's figures for two JSONL outputs of one input (`records`: its record count, at most):
    `records` and, under `embeddings`, `text` or `classification` by `task`, that task's figures. Raises
    `OutputsDiffer` when the outputs are not of one input."""
    name, figures = _figures_for(task, records=records, limits=limits)
    counts = {"compared": 0, "both_ok": 0, "ok_to_error": 0, "error_to_ok": 0, "both_error": 0}
    for pair in output_pairs(old_uri, new_uri):
        counts["compared"] += 1
        old_ok, new_ok = "response" in pair.old, "response" in pair.new
        if old_ok and new_ok:
            counts["both_ok"] += 1
            figures.add(pair)
        elif old_ok:
            counts["ok_to_error"] += 1
        elif new_ok:
            counts["error_to_ok"] += 1
        else:
            counts["both_error"] += 1
    report_figures = figures.figures()
    if isinstance(figures, EmbeddingComparison):
        counts["not_compared"] = figures.not_compared
    return {"records": counts, name: report_figures}
