"""vLLM's engine statistics, carried from a slot process to its launcher's `/metrics`.

The offline `vllm.LLM` keeps its statistics in its own process (`LLM.get_metrics()`, with
``disable_log_stats=False``): counters, gauges, histograms and vectors, named `vllm:*`. A slot
running a vLLM model writes a snapshot of them, at most every `SNAPSHOT_INTERVAL_S`, as JSON into
the multiprocess directory (``vllm_<pid>.json``, replaced atomically); the launcher re-exports the
snapshots of its live slot processes under vLLM's own names and types, adding the slot's labels, so
that dashboards built for vLLM's `/metrics` keep working.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from gpuworkers.metrics import SLOT_LABELS, slot_labels

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 5.0
_last_written = 0.0


def snapshot_entries(vllm_metrics: Iterable[Any]) -> list[dict[str, Any]]:
    """vLLM's metric objects (`vllm.v1.metrics.reader`: Counter, Gauge, Histogram, Vector) as JSON values."""
    entries: list[dict[str, Any]] = []
    for metric in vllm_metrics:
        kind = type(metric).__name__.lower()
        entry: dict[str, Any] = {"type": kind, "name": metric.name, "labels": dict(metric.labels)}
        if kind in ("counter", "gauge"):
            entry["value"] = float(metric.value)
        elif kind == "histogram":
            entry.update(count=float(metric.count), sum=float(metric.sum), buckets=dict(metric.buckets))
        elif kind == "vector":
            entry["values"] = [float(value) for value in metric.values]
        else:
            continue
        entries.append(entry)
    return entries


def publish_vllm_metrics(llm: Any, *, force: bool = False) -> None:
    """Write `llm`'s statistics for the launcher, at most every SNAPSHOT_INTERVAL_S; best effort."""
    global _last_written
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    now = time.monotonic()
    if not directory or (not force and now - _last_written < SNAPSHOT_INTERVAL_S):
        return
    _last_written = now
    try:
        entries = snapshot_entries(llm.get_metrics())
    except Exception as exc:
        logger.warning("vLLM statistics not read: %s", exc)
        return
    target = Path(directory) / f"vllm_{os.getpid()}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps({"slot": list(slot_labels()), "metrics": entries}))
    partial.replace(target)


def _merge(entries: list[tuple[list[str], dict[str, Any]]]) -> Iterator[Metric]:
    families: dict[str, Any] = {}
    for slot, entry in entries:
        label_names = (*SLOT_LABELS, *sorted(entry["labels"]))
        label_values = [*slot, *(str(entry["labels"][key]) for key in sorted(entry["labels"]))]
        key = entry["name"]
        kind = entry["type"]
        if kind == "gauge":
            family = families.setdefault(key, GaugeMetricFamily(key, f"vLLM's {key}", labels=label_names))
            family.add_metric(label_values, entry["value"])
        elif kind == "counter":
            family = families.setdefault(key, CounterMetricFamily(key, f"vLLM's {key}", labels=label_names))
            family.add_metric(label_values, entry["value"])
        elif kind == "vector":
            # One counter per position, as vLLM's own /metrics exports this vector.
            family = families.setdefault(
                key, CounterMetricFamily(key, f"vLLM's {key}", labels=(*label_names, "position"))
            )
            for position, value in enumerate(entry["values"]):
                family.add_metric([*label_values, str(position)], value)
        elif kind == "histogram":
            family = families.setdefault(key, HistogramMetricFamily(key, f"vLLM's {key}", labels=label_names))
            # vLLM's reader gives each upper bound's cumulative count, as Prometheus's buckets are.
            bounds = sorted(entry["buckets"].items(), key=lambda item: float(item[0]))
            buckets = [("+Inf" if float(bound) == float("inf") else bound, float(count)) for bound, count in bounds]
            family.add_metric(label_values, buckets, sum_value=entry["sum"])
    yield from families.values()


def read_vllm_snapshots(directory: Path) -> Iterator[Metric]:
    """The metric families of every snapshot in `directory` (the launcher drops those of dead processes)."""
    entries: list[tuple[list[str], dict[str, Any]]] = []
    for path in sorted(directory.glob("vllm_*.json")):
        try:
            snapshot = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        entries.extend((snapshot["slot"], entry) for entry in snapshot["metrics"])
    yield from _merge(entries)
