"""The budget's hold of a job: its output tokens (max_tokens, or the model's default, times n), the dearest
price of its model and adapters, and its whole input, never the low bound's discounts."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from portal.catalog.models import Adapter, Model
from portal.jobs.cost_estimate import cost_estimate
from tests.factories import ModelFactory
from tests.support.ledger import price

pytestmark = pytest.mark.django_db

DAY = dt.date(2026, 11, 10)


@pytest.fixture
def llm(db: None) -> Model:
    return ModelFactory(
        name="tiny-llm",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.CHAT,
        is_default=False,
        default_params={"max_tokens": 100},
    )


def _hold(model: Model, *, adapter_ids: list[int] = [], params: dict[str, Any] | None = None, **kw: Any) -> Decimal:  # noqa: B006
    figures = {"gpu_seconds": 0.0, "input_tokens": 0, "records": 1_000, **kw}
    return cost_estimate(model=model, adapter_ids=adapter_ids, params=params or {}, day=DAY, **figures).hold


def test_the_hold_counts_the_output_the_params_allow_times_n_where_the_low_bound_counts_none(llm: Model) -> None:
    price(llm, per_million_output_tokens="10")
    # 1,000 records * 100 tokens (the model's default max_tokens) at 10 a million.
    assert _hold(llm) == Decimal("1.00")
    assert _hold(llm, params={"max_tokens": 500, "n": 3}) == Decimal("15.00")
    estimate = cost_estimate(
        model=llm, adapter_ids=[], gpu_seconds=0, input_tokens=0, records=1_000, params={}, day=DAY
    )
    assert estimate.low == Decimal("0.00") < estimate.hold


def test_the_hold_prices_every_figure_at_the_dearest_of_the_job_s_adapters(llm: Model, acme: Any) -> None:
    cheap = Adapter.objects.create(name="cheap", base_model=llm, owner=acme, source="/a", rank=4)
    dear = Adapter.objects.create(name="dear", base_model=llm, owner=acme, source="/b", rank=4)
    price(llm, per_gpu_second="1", per_million_input_tokens="1", per_million_output_tokens="1")
    price(llm, adapter=cheap, per_gpu_second="0.1", per_million_input_tokens="0.1", per_million_output_tokens="0.1")
    price(llm, adapter=dear, per_gpu_second="2", per_million_input_tokens="4", per_million_output_tokens="8")
    hold = _hold(llm, adapter_ids=[cheap.pk, dear.pk], gpu_seconds=10, input_tokens=1_000_000)
    # 10 s * 2 + 1 M in * 4 + 1,000 * 100 out * 8 / M.
    assert hold == Decimal("24.80")
    low = cost_estimate(
        model=llm,
        adapter_ids=[cheap.pk, dear.pk],
        gpu_seconds=10,
        input_tokens=1_000_000,
        records=1_000,
        params={},
        day=DAY,
    ).low
    assert low < Decimal("1")  # the low bound takes the cheapest, divided by the estimate's factor


def test_the_hold_of_a_sample_reaches_the_whole_input(llm: Model) -> None:
    price(llm, per_million_input_tokens="1")
    assert _hold(llm, input_tokens=1_000_000, reach=4.0, params={"max_tokens": 1}) == Decimal("4.00")
