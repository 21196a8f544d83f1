"""Writes to the control side's counters and histograms, kept in the database.

All the increments of one event go in one `INSERT ... ON CONFLICT DO UPDATE` (PostgreSQL and
SQLite both have it), inside the caller's transaction: the counts commit or roll back with the
event they count, and concurrent writers add up instead of overwriting each other.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from django.db import connection

from portal.ops.metrics.families import Family
from portal.ops.models import MetricSample

Increment = tuple[str, str, float]


def labels_key(labels: Mapping[str, str]) -> str:
    return json.dumps(dict(labels), sort_keys=True, separators=(",", ":"))


def counter_increment(family: Family, labels: Mapping[str, str], amount: float = 1.0) -> list[Increment]:
    if family.kind != "counter":
        raise ValueError(f"{family.name} is a {family.kind}, not a counter")
    return [(family.sample(), labels_key(labels), amount)] if amount else []


def histogram_increments(family: Family, labels: Mapping[str, str], value: float) -> list[Increment]:
    """One observation: +1 in every bucket whose bound holds it (buckets are cumulative), the sum and count."""
    if family.kind != "histogram":
        raise ValueError(f"{family.name} is a {family.kind}, not a histogram")
    increments = [
        (family.sample("_bucket"), labels_key({**labels, "le": _bound(bound)}), 1.0)
        for bound in (*family.buckets, math.inf)
        if value <= bound
    ]
    increments.append((family.sample("_sum"), labels_key(labels), value))
    increments.append((family.sample("_count"), labels_key(labels), 1.0))
    return increments


def _bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def samples_add(increments: Iterable[Increment]) -> None:
    """Add every increment in one statement, in the caller's transaction."""
    summed: dict[tuple[str, str], float] = defaultdict(float)
    for name, labels, amount in increments:
        summed[(name, labels)] += amount
    if not summed:
        return
    table = connection.ops.quote_name(MetricSample._meta.db_table)
    rows = ", ".join(["(%s, %s, %s)"] * len(summed))
    params = [part for (name, labels), amount in summed.items() for part in (name, labels, amount)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (name, labels, value) VALUES {rows} "
            f"ON CONFLICT (name, labels) DO UPDATE SET value = {table}.value + excluded.value",
            params,
        )
