"""What jobs cost: the usage ledger priced by the catalog's prices (`portal.catalog.pricing`).

A ledger line (one per ending of a job: its first and each retry round's) is priced once, when it is
written (`usage_record`), by the prices in force on the day it was recorded (`Price.effective_from`), and
its cost is kept on the line (`JobUsage.cost`): a bill's lines never change after the fact, whatever price,
adapter or model is added or deleted later, or however often the job is retried. Every
reader (the usage API, the chargeback, the budget) reads the kept cost; a line written before costs
were kept is priced on its first read and kept from then on. The rule for one line:

    cost = sum over its parts [ gpu_seconds * per GPU-second
                              + (prompt - cached) * input price + cached * cached-input price
                              + completion * output price ]   (token prices per million)

A job that ran no adapter is one part, at its model's price. A job that ran adapters has one part per
adapter (and one for its base model where records ran bare), from `JobAdapterUsage`, each at its
adapter's price: its own tokens; the GPU-seconds, known only for the whole job, split by the part's
records over the job's; the cached prompt tokens, known only for the whole job too, split by the
part's prompt tokens. The sum is rounded once, to the currency's minor unit: a job is billed in whole
cents, so every total (a month, a model, a tenant's chargeback) is a sum of lines and adds up exactly.
A model with no price in force costs nothing.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import QuerySet, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from portal.catalog.models import Price
from portal.catalog.money import MILLION, ZERO, to_minor_unit
from portal.catalog.pricing import PriceBook
from portal.jobs.models import UNSETTLED, Job, JobUsage

FREEZE_BATCH = 1000
"""Old lines priced and kept per statement on their first read."""


@dataclass(frozen=True)
class Consumption:
    """What a job used under one price: its model bare, or one adapter."""

    adapter_id: int | None
    """The adapter priced (None: the model bare, or an adapter deleted since, priced as the model)."""
    records: int
    prompt_tokens: int
    cached_prompt_tokens: Decimal
    """Shared out of the job's (see the module), so possibly a fraction."""
    completion_tokens: int
    gpu_seconds: Decimal

    def cost(self, price: Price | None) -> Decimal:
        """At `price` (None: unpriced, free), unrounded."""
        if price is None:
            return ZERO
        uncached = self.prompt_tokens - self.cached_prompt_tokens
        tokens = (
            uncached * price.per_million_input_tokens
            + self.cached_prompt_tokens * price.cached_input_price
            + self.completion_tokens * price.per_million_output_tokens
        ) / MILLION
        return self.gpu_seconds * price.per_gpu_second + tokens


def _decimal(seconds: float | None) -> Decimal:
    # Through repr: the float's shortest decimal, not its binary expansion's 50 digits.
    return Decimal(repr(float(seconds or 0.0)))


def parts_of(
    *, gpu_seconds: Decimal, cached_prompt_tokens: int, splits: Iterable[Mapping[str, Any]], whole: Mapping[str, Any]
) -> list[Consumption]:
    """A job's usage as priced parts: `splits` (per adapter: adapter_id, records, prompt_tokens, completion_tokens),
    or `whole` (the same keys, adapter_id None) where there are none; GPU-seconds and cached tokens shared out
    as the module says."""
    rows = list(splits) or [whole]
    records = sum(row["records"] for row in rows)
    prompt = sum(row["prompt_tokens"] for row in rows)
    parts = []
    for row in rows:
        seconds_share = Decimal(row["records"]) / records if records else Decimal(1) / len(rows)
        cached_share = Decimal(row["prompt_tokens"]) / prompt if prompt else ZERO
        parts.append(
            Consumption(
                adapter_id=row["adapter_id"],
                records=row["records"],
                prompt_tokens=row["prompt_tokens"],
                cached_prompt_tokens=cached_prompt_tokens * cached_share,
                completion_tokens=row["completion_tokens"],
                gpu_seconds=gpu_seconds * seconds_share,
            )
        )
    return parts


def parts_cost(
    parts: Iterable[Consumption], *, book: PriceBook, model_id: int, gpu_class_id: int | None, day: dt.date
) -> Decimal:
    """The parts priced at the prices in force on `day`, summed and rounded to the currency's minor unit."""
    total = sum(
        (
            part.cost(book.price(model_id=model_id, adapter_id=part.adapter_id, gpu_class_id=gpu_class_id, day=day))
            for part in parts
        ),
        ZERO,
    )
    return to_minor_unit(total, settings.BATCHERY_CURRENCY)


def usage_cost(usage: JobUsage, *, book: PriceBook) -> Decimal:
    """The cost of one ledger line (read with `model` and its `adapters`), rounded to the minor unit."""
    splits = [
        {
            "adapter_id": split.adapter_id,
            "records": split.records_succeeded + split.records_failed,
            "prompt_tokens": split.prompt_tokens,
            "completion_tokens": split.completion_tokens,
        }
        for split in usage.adapters.all()
    ]
    return line_cost(usage, splits=splits, gpu_class_id=usage.model.gpu_class_id, book=book)


def line_cost(
    usage: JobUsage, *, splits: Iterable[Mapping[str, Any]], gpu_class_id: int | None, book: PriceBook | None = None
) -> Decimal:
    """The cost of a ledger line from its figures and its split by adapter (`parts_of`'s `splits`), at the
    prices in force the day it was recorded, rounded to the minor unit: what `usage_record` keeps on it."""
    book = book or PriceBook(model_ids=[usage.model_id])
    whole = {
        "adapter_id": None,
        "records": usage.records_succeeded + usage.records_failed,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    parts = parts_of(
        gpu_seconds=_decimal(usage.gpu_seconds),
        cached_prompt_tokens=usage.cached_prompt_tokens,
        splits=splits,
        whole=whole,
    )
    day = usage.recorded_at.astimezone(dt.UTC).date()
    return parts_cost(parts, book=book, model_id=usage.model_id, gpu_class_id=gpu_class_id, day=day)


def usage_costs(lines: Iterable[JobUsage]) -> dict[Any, Decimal]:
    """Each ledger line's kept cost by its id; a line without one yet is priced now and kept (`usage_freeze`)."""
    lines = list(lines)
    usage_freeze([line for line in lines if line.cost is None])
    return {line.pk: _minor(line.cost) for line in lines}


def _minor(kept: Decimal | None) -> Decimal:
    # A kept cost is already whole minor units; the column's ten places are only its storage.
    return to_minor_unit(kept or ZERO, settings.BATCHERY_CURRENCY)


def usage_freeze(lines: Iterable[JobUsage]) -> None:
    """Price lines that have no kept cost (read with `priced_lines`), with one read of the prices, and keep it.

    Called only for lines whose cost is empty: a line's cost, once kept, is never written again."""
    lines = list(lines)
    if not lines:
        return
    book = PriceBook(model_ids={line.model_id for line in lines})
    for line in lines:
        line.cost = usage_cost(line, book=book)
    # Two readers freezing the same old line at once price it alike: the same prices, the same day.
    JobUsage.objects.bulk_update(lines, ["cost"], batch_size=FREEZE_BATCH)


def priced_lines(usage: QuerySet[JobUsage]) -> QuerySet[JobUsage]:
    """Ledger lines read with what pricing them needs."""
    return usage.select_related("model", "tenant").prefetch_related("adapters")


def kept_costs(usage: QuerySet[JobUsage]) -> QuerySet[JobUsage]:
    """`usage` once every line of it has its cost kept (old lines priced now, once), ready to be summed in the
    database: a bill's reads cost one grouped query, not the pricing of every line."""
    usage_freeze(priced_lines(usage.filter(cost__isnull=True)))
    return usage.order_by()


@dataclass(frozen=True)
class PeriodCost:
    """A month's cost, in all and per model (`name@version`)."""

    period: dt.date
    cost: Decimal
    models: dict[str, Decimal]


def cost_per_month(usage: QuerySet[JobUsage]) -> dict[dt.date, PeriodCost]:
    """The lines' kept costs summed per month and, within it, per model, in one grouped query: each line was
    priced once when it was written, so a closed month's figures never change and no read re-prices them."""
    sums = (
        kept_costs(usage)
        .values("period", "model__name", "model__version")
        .annotate(total=Sum("cost"))
        .values_list("period", "model__name", "model__version", "total")
    )
    totals: dict[dt.date, dict[str, Decimal]] = defaultdict(lambda: defaultdict(lambda: ZERO))
    for period, name, version, total in sums:
        totals[period][f"{name}@{version}"] += _minor(total)
    return {
        period: PeriodCost(period=period, cost=sum(models.values(), ZERO), models=dict(sorted(models.items())))
        for period, models in totals.items()
    }


def job_cost_so_far(job: Job, *, round_: int | None = None) -> Decimal:
    """What a job's ended shards (of round `round_` only, where given) cost so far (their settled tokens and
    seconds), at today's prices; once a round ends, its ledger line's cost is the one billed. Summed in the
    database: the budget asks it at every settling of a running job, so only the shards that ran adapters are
    read row by row."""
    settled = job.shards.exclude(status__in=UNSETTLED)
    if round_ is not None:
        settled = settled.filter(round=round_)
    sums = settled.aggregate(
        records=Coalesce(Sum("record_count"), 0),
        prompt=Coalesce(Sum("prompt_tokens"), 0),
        completion=Coalesce(Sum("completion_tokens"), 0),
        cached=Coalesce(Sum("cached_prompt_tokens"), 0),
        compute=Coalesce(Sum("compute_seconds"), 0.0),
        load=Coalesce(Sum("load_seconds"), 0.0),
    )
    seconds = _decimal(sums["compute"]) + _decimal(sums["load"])
    ids = {key: entry["id"] for key, entry in _adapter_keys(job).items()}
    by_adapter: dict[str, list[int]] = {}
    for usage in settled.exclude(adapter_usage={}).values_list("adapter_usage", flat=True) if job.adapters else ():
        for key, counts in (usage or {}).items():
            summed = by_adapter.setdefault(key, [0, 0, 0, 0])
            for position, count in enumerate(counts):
                summed[position] += count
    splits = [
        {"adapter_id": ids.get(key), "records": c[0] + c[1], "prompt_tokens": c[2], "completion_tokens": c[3]}
        for key, c in sorted(by_adapter.items())
    ]
    whole = {
        "adapter_id": None,
        "records": sums["records"],
        "prompt_tokens": sums["prompt"],
        "completion_tokens": sums["completion"],
    }
    parts = parts_of(
        gpu_seconds=seconds * job.model.gpus_per_replica,
        cached_prompt_tokens=sums["cached"],
        splits=splits,
        whole=whole,
    )
    book = PriceBook(model_ids=[job.model_id])
    return parts_cost(
        parts, book=book, model_id=job.model_id, gpu_class_id=job.model.gpu_class_id, day=timezone.now().date()
    )


def _adapter_keys(job: Job) -> dict[str, dict[str, Any]]:
    """The job's adapters by the key shards count them under (`name@version`), as the ledger reads them."""
    return {f"{entry['spec']['name']}@{entry['spec']['version']}": entry for entry in job.adapters.values()}


def job_cost(job: Job) -> Decimal:
    """What a job costs: once it has ended, the sum of its ledger lines' costs (one per ending: its first and each
    retry round's); before, and while a retry runs, its ended shards' (`job_cost_so_far`)."""
    lines = list(priced_lines(JobUsage.objects.filter(job=job))) if job.is_finished else []
    if lines:
        return sum(usage_costs(lines).values(), ZERO)
    return job_cost_so_far(job)
