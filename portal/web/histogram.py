"""A histogram of a comparison report drawn as SVG bars, computed here so the page needs no script."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WIDTH = 600
HEIGHT = 160
LABEL_HEIGHT = 18


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    count: int
    label: str
    """The bin, `[left, right)`, as a person reads it."""


def histogram_bars(histogram: dict[str, Any]) -> list[Bar]:
    """One bar a bin of a report's `histogram` (`edges`, `counts`), of equal widths (the bins' own widths
    differ: the cosine's narrow near 1), heights in proportion to the largest count."""
    edges, counts = histogram["edges"], histogram["counts"]
    if not counts:
        return []
    tallest = max(counts) or 1
    width = WIDTH / len(counts)
    usable = HEIGHT - LABEL_HEIGHT
    bars = []
    for index, count in enumerate(counts):
        height = usable * count / tallest
        bars.append(
            Bar(
                x=index * width,
                y=usable - height,
                width=width - 2,
                height=height,
                count=count,
                label=f"{edges[index]:g}..{edges[index + 1]:g}",
            )
        )
    return bars
