"""Metric names: the catalog in docs/operations.md's Monitoring section, and the names a text uses (PromQL, a scrape).

The deploy tests check that the alerts and the dashboard use only catalogued metrics; a live scrape
of `/metrics` can be checked against the same catalog.
"""

from __future__ import annotations

import re
from pathlib import Path

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
CATALOG_HEADING = "## Monitoring"

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
"""The series a histogram `X` is exposed as; stripped to give `X`. No catalogued name ends this way,
which `test_no_catalogued_metric_ends_like_a_histogram_series` keeps true."""

# A name starts where no name character comes before it: `{__name__="batchery_x"}` and
# `(batchery_x[5m])` both count, `my_batchery_x` does not.
_NAME = re.compile(r"(?<![A-Za-z0-9_:])(batchery_[a-z0-9_]*[a-z0-9]|vllm:[a-z0-9_:]*[a-z0-9])")
_TABLE_ROW_NAME = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def referenced_metric_names(text: str) -> set[str]:
    """The Batchery (`batchery_…`) and vLLM (`vllm:…`) metric names used in `text`, as base names.

    Histogram series (`_bucket`, `_sum`, `_count`) are reported as the histogram's name. Lines that
    start with `#` are skipped, so exposition text's `# HELP`/`# TYPE` lines (which name a counter
    without its `_total`) do not count. A scrape's `_created` series are left as they are.
    """
    names: set[str] = set()
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for name in _NAME.findall(line):
            suffix = next((suffix for suffix in HISTOGRAM_SUFFIXES if name.endswith(suffix)), "")
            names.add(name.removesuffix(suffix))
    return names


def catalog_metric_names(path: Path = OPERATIONS) -> set[str]:
    """The backticked names in the first column of the Monitoring section's tables (`vllm:*` stays a pattern)."""
    names: set[str] = set()
    section = path.read_text().split(CATALOG_HEADING, 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        match = _TABLE_ROW_NAME.match(line)
        if match:
            names.add(match.group(1))
    return names


def is_catalogued(name: str, catalog: set[str]) -> bool:
    """Whether `name` is in the catalog, where an entry ending in `*` (`vllm:*`) stands for a prefix."""
    return name in catalog or any(entry.endswith("*") and name.startswith(entry[:-1]) for entry in catalog)
