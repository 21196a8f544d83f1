"""A month's chargeback: what each tenant's jobs cost it, per model, as CSV for the operators' books.

One row per tenant and model that has ledger lines in the month, each the sum of those lines (their
costs as `portal.jobs.billing` prices them, each already rounded to the minor unit), so the rows add
up exactly to the month's ledger. No total row: a spreadsheet's sum of the `cost` column is the total.
"""

from __future__ import annotations

import csv
import datetime as dt
from collections import defaultdict
from dataclasses import astuple, dataclass, fields
from decimal import Decimal
from typing import Any, Protocol

from django.conf import settings

from portal.catalog.money import ZERO
from portal.jobs.billing import priced_lines, usage_costs
from portal.jobs.models import JobUsage


@dataclass
class ChargebackRow:
    """One tenant's use of one model in the month."""

    month: str
    """YYYY-MM."""
    tenant: str
    model: str
    """name@version."""
    jobs: int = 0
    """Jobs with a line in the month, each once (a job retried within it has several)."""
    records_succeeded: int = 0
    records_failed: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    currency: str = ""
    cost: Decimal = ZERO


class Writable(Protocol):
    def write(self, text: str, /) -> object: ...


COLUMNS = [field.name for field in fields(ChargebackRow)]


def parse_month(value: str) -> dt.date:
    """`YYYY-MM` as the first day of that month (the ledger's `period`); ValueError otherwise."""
    try:
        return dt.datetime.strptime(value, "%Y-%m").date()
    except ValueError:
        raise ValueError(f"a month is written YYYY-MM, e.g. 2026-11, not {value!r}") from None


def chargeback_rows(*, month: dt.date) -> list[ChargebackRow]:
    """The month's ledger summed per tenant and model, by tenant then model name."""
    lines = list(priced_lines(JobUsage.objects.filter(period=month)))
    costs = usage_costs(lines)
    rows: dict[tuple[str, str], ChargebackRow] = defaultdict(lambda: ChargebackRow(month="", tenant="", model=""))
    # A job that ended more than once in the month (its retries) has a line per ending, and counts once.
    jobs: dict[tuple[str, str], set[Any]] = defaultdict(set)
    for line in lines:
        key = (line.tenant.name, str(line.model))
        row = rows[key]
        row.month, row.tenant, row.model = month.strftime("%Y-%m"), line.tenant.name, str(line.model)
        jobs[key].add(line.job_id)
        row.jobs = len(jobs[key])
        row.records_succeeded += line.records_succeeded
        row.records_failed += line.records_failed
        row.prompt_tokens += line.prompt_tokens
        row.cached_prompt_tokens += line.cached_prompt_tokens
        row.completion_tokens += line.completion_tokens
        row.gpu_seconds += line.gpu_seconds
        row.currency = settings.BATCHERY_CURRENCY
        row.cost += costs[line.pk]
    return [rows[key] for key in sorted(rows)]


def chargeback_write(rows: list[ChargebackRow], out: Writable) -> None:
    """The rows as CSV, a header naming the columns first; GPU-seconds to the millisecond."""
    writer = csv.writer(out)
    writer.writerow(COLUMNS)
    for row in rows:
        values = list(astuple(row))
        values[COLUMNS.index("gpu_seconds")] = f"{row.gpu_seconds:.3f}"
        writer.writerow(values)
