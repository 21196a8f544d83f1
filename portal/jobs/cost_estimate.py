"""A job's cost before it runs, as the dry run reports it: a low and a high bound.

Built from the dry run's own figures: its estimated GPU-seconds, the input tokens its tokenizer counted
(extrapolated where it read a sample) and its records, at the prices in force today. Either figure may
land off the estimate: the learned throughput drifts, a slot may load the model, a chat template adds
tokens and truncation removes some; BATCHERY_COST_ESTIMATE_FACTOR (f) is how far either may land. So

    low  = gpu_seconds / f * cheapest per-second + input_tokens / f * cheapest input price (cached or not)
    high = gpu_seconds * f * dearest per-second  + input_tokens * f * dearest input price
           + records * max_tokens * dearest output price

where cheapest and dearest range over the prices of the model and of each adapter the job runs. Output
tokens are not known before the run: the low bound counts none, the high bound the most the job's params
allow (`max_completion_tokens` or `max_tokens`); a generating job whose params set neither has no high
bound (None), as a record's own params may ask for more. An embedding or classifying job makes none.

The budget quota holds a job to its `hold`, what it is expected to cost without favour:

    hold = (gpu_seconds * dearest per-second + input_tokens * dearest input price
            + records * output_tokens * n * dearest output price) * reach

where output_tokens * n is each record's own: `max_completion_tokens` or `max_tokens` of its params over
the job's over the model's defaults (the engines' own default, 16, where none sets it), times the
completions `n` it asks (`OutputCaps` sums them over the records the dry run read, an OpenAI batch's
lines each with their own `max_tokens`); `reach` extends a sample read from the start of the input to the
whole input's size (1: all was read).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.utils import timezone

from portal.catalog.models import Model, Price
from portal.catalog.money import MILLION, ZERO, to_minor_unit
from portal.catalog.pricing import PriceBook

GENERATING = (Model.Task.GENERATE, Model.Task.CHAT)


@dataclass(frozen=True)
class CostEstimate:
    """A job's cost before it runs, in the deployment's currency, rounded to its minor unit."""

    low: Decimal
    """What the job costs at least (the budget quota's figure)."""
    high: Decimal | None
    """What it costs at most; None: no bound (a generating job whose params do not cap its output)."""
    currency: str
    priced: bool
    """False: the model has no price in force, so the job costs nothing."""
    hold: Decimal
    """What the budget quota holds for the job while it runs (see the module)."""


def cost_estimate(
    *,
    model: Model,
    adapter_ids: Collection[int],
    gpu_seconds: float,
    input_tokens: int | None,
    records: int,
    params: Mapping[str, Any],
    day: dt.date | None = None,
    reach: float = 1.0,
    output_tokens: int | None = None,
) -> CostEstimate:
    """The bounds of a job's cost from the dry run's estimates (see the module). `input_tokens` None: the
    engine has no tokenizer, so the input's tokens are bounded by 0 and, where they are priced, nothing.
    `output_tokens`: the records' output caps times their `n`, summed (`OutputCaps`) and scaled to the whole
    input; None: `records` at the job's own cap."""
    day = day or timezone.now().date()
    book = PriceBook(model_ids=[model.pk])
    found = [
        book.price(model_id=model.pk, adapter_id=adapter_id, gpu_class_id=model.gpu_class_id, day=day)
        for adapter_id in [None, *adapter_ids]
    ]
    prices = [price for price in found if price is not None]
    currency = settings.BATCHERY_CURRENCY
    if not prices:
        free = to_minor_unit(ZERO, currency)
        return CostEstimate(low=free, high=free, currency=currency, priced=False, hold=free)
    factor = Decimal(repr(settings.BATCHERY_COST_ESTIMATE_FACTOR))
    seconds = Decimal(repr(float(gpu_seconds)))
    tokens = Decimal(input_tokens or 0)
    low = (
        seconds / factor * min(p.per_gpu_second for p in prices)
        + tokens / factor * min(min(p.per_million_input_tokens, p.cached_input_price) for p in prices) / MILLION
    )
    high: Decimal | None = seconds * factor * max(p.per_gpu_second for p in prices)
    dearest_input = max(max(p.per_million_input_tokens, p.cached_input_price) for p in prices)
    if input_tokens is None and dearest_input > 0:
        high = None
    elif high is not None:
        high += tokens * factor * dearest_input / MILLION
    dearest_output = max(p.per_million_output_tokens for p in prices)
    if high is not None and model.task in GENERATING and dearest_output > 0:
        cap = _max_output_tokens(params)
        high = None if cap is None else high + records * cap * dearest_output / MILLION
    return CostEstimate(
        low=_round_down(low, currency),
        high=None if high is None else _round_up(high, currency),
        currency=currency,
        priced=True,
        hold=_round_up(_hold(model, prices, seconds, tokens, records, params, reach, output_tokens), currency),
    )


# What the engines generate where neither the job nor the model caps it (vLLM's and OpenAI's default).
ENGINE_DEFAULT_OUTPUT_TOKENS = 16


def _hold(
    model: Model,
    prices: list[Price],
    seconds: Decimal,
    tokens: Decimal,
    records: int,
    params: Mapping[str, Any],
    reach: float,
    output_tokens: int | None,
) -> Decimal:
    """The budget's hold (see the module): every figure at the dearest of the job's prices."""
    hold = seconds * max(p.per_gpu_second for p in prices)
    hold += tokens * max(max(p.per_million_input_tokens, p.cached_input_price) for p in prices) / MILLION
    if model.task in GENERATING:
        if output_tokens is None:
            output_tokens = records * OutputCaps(model, params).record_cap(None)
        hold += output_tokens * max(p.per_million_output_tokens for p in prices) / MILLION
    return hold * Decimal(repr(max(float(reach), 1.0)))


class OutputCaps:
    """Sums the most tokens each record may generate, all its completions together, as the engines read its
    params: its own over the job's over the model's defaults."""

    def __init__(self, model: Model, params: Mapping[str, Any]) -> None:
        self._base = {**model.default_params, **params}
        self._job_cap = self._cap(self._base)
        self.total = 0

    def record_cap(self, own: Any) -> int:
        """The output tokens a record with params `own` (its `params` field, if any) may generate."""
        return self._cap({**self._base, **own}) if isinstance(own, Mapping) and own else self._job_cap

    def add(self, own: Any) -> None:
        self.total += self.record_cap(own)

    @staticmethod
    def _cap(params: Mapping[str, Any]) -> int:
        n = params.get("n")
        completions = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        return (_max_output_tokens(params) or ENGINE_DEFAULT_OUTPUT_TOKENS) * completions


def _max_output_tokens(params: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = params.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _round_down(amount: Decimal, currency: str) -> Decimal:
    # Rounded outwards, so that the bounds still hold the cost rounded to the minor unit.
    rounded = to_minor_unit(amount, currency)
    return rounded if rounded <= amount else rounded - _unit(rounded)


def _round_up(amount: Decimal, currency: str) -> Decimal:
    rounded = to_minor_unit(amount, currency)
    return rounded if rounded >= amount else rounded + _unit(rounded)


def _unit(rounded: Decimal) -> Decimal:
    return Decimal(1).scaleb(rounded.as_tuple().exponent)  # type: ignore[arg-type]
