"""What jobs cost: ledger lines priced at the price in force the day they were recorded; the chargeback."""

from __future__ import annotations

import csv
import datetime as dt
import io
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import ProtectedError

from portal.catalog.adapters import adapter_delete
from portal.catalog.models import Adapter, Price
from portal.jobs.billing import cost_per_month, usage_costs
from portal.jobs.chargeback import COLUMNS
from portal.jobs.models import Job, JobAdapterUsage, JobStatus, JobUsage, Shard
from portal.jobs.usage import usage_record
from tests.factories import GpuClassFactory, ModelFactory, TenantFactory, UserFactory
from tests.support.ledger import ledger_line, price

pytestmark = pytest.mark.django_db

NOV_10 = dt.datetime(2026, 11, 10, 12, tzinfo=dt.UTC)
NOV_20 = dt.datetime(2026, 11, 20, 12, tzinfo=dt.UTC)


def _cost(line: JobUsage) -> Decimal:
    return usage_costs(JobUsage.objects.filter(pk=line.pk).select_related("model").prefetch_related("adapters"))[
        line.pk
    ]


def test_a_line_costs_its_gpu_seconds_and_its_tokens_cached_ones_at_their_own_price(acme: Any, minilm: Any) -> None:
    price(
        minilm,
        per_gpu_second="0.001",
        per_million_input_tokens="0.50",
        per_million_cached_input_tokens="0.10",
        per_million_output_tokens="2",
    )
    line = ledger_line(
        acme, minilm, recorded_at=NOV_10, gpu_seconds=11.5, prompt=2_000_000, cached=500_000, completion=1_000_000
    )
    # 11.5 s * 0.001 + 1.5 M * 0.50 + 0.5 M * 0.10 + 1 M * 2 = 2.8115, billed in cents.
    assert _cost(line) == Decimal("2.81")


def test_cached_tokens_without_a_price_of_their_own_cost_the_input_price(acme: Any, minilm: Any) -> None:
    price(minilm, per_million_input_tokens="1")
    line = ledger_line(acme, minilm, recorded_at=NOV_10, prompt=3_000_000, cached=1_000_000)
    assert _cost(line) == Decimal("3.00")


def test_a_price_change_mid_month_prices_each_job_by_the_day_it_was_recorded(acme: Any, minilm: Any) -> None:
    price(minilm, per_gpu_second="0.01", effective_from=dt.date(2026, 11, 1))
    before = ledger_line(acme, minilm, recorded_at=NOV_10, gpu_seconds=100)
    price(minilm, per_gpu_second="0.02", effective_from=dt.date(2026, 11, 15))
    after = ledger_line(acme, minilm, recorded_at=NOV_20, gpu_seconds=100)
    assert (_cost(before), _cost(after)) == (Decimal("1.00"), Decimal("2.00"))
    # A later price leaves the month as it was billed.
    price(minilm, per_gpu_second="0.05", effective_from=dt.date(2026, 12, 1))
    assert (_cost(before), _cost(after)) == (Decimal("1.00"), Decimal("2.00"))
    month = cost_per_month(JobUsage.objects.filter(tenant=acme))[dt.date(2026, 11, 1)]
    assert month.cost == Decimal("3.00") and month.models == {str(minilm): Decimal("3.00")}


def test_a_job_recorded_before_any_price_costs_nothing(acme: Any, minilm: Any) -> None:
    price(minilm, per_gpu_second="1", effective_from=dt.date(2026, 12, 1))
    assert _cost(ledger_line(acme, minilm, recorded_at=NOV_10, gpu_seconds=10)) == Decimal("0.00")


def test_a_price_for_the_gpu_class_beats_the_price_for_any_class(acme: Any, minilm: Any) -> None:
    price(minilm, per_gpu_second="1")
    price(minilm, gpu_class=minilm.gpu_class, per_gpu_second="3")
    price(minilm, gpu_class=GpuClassFactory(name="h100"), per_gpu_second="7")
    assert _cost(ledger_line(acme, minilm, recorded_at=NOV_10, gpu_seconds=2)) == Decimal("6.00")


def test_adapters_are_priced_apart_each_on_its_own_tokens_and_share_of_gpu_seconds(acme: Any) -> None:
    base = ModelFactory(name="base-llm", is_default=False)
    alpha = Adapter.objects.create(name="alpha", base_model=base, owner=acme, source="/x", rank=4)
    beta = Adapter.objects.create(name="beta", base_model=base, owner=acme, source="/y", rank=4)
    price(base, per_gpu_second="1", per_million_input_tokens="1", per_million_output_tokens="1")
    price(base, adapter=alpha, per_gpu_second="2", per_million_input_tokens="10", per_million_output_tokens="20")
    line = ledger_line(acme, base, recorded_at=NOV_10, gpu_seconds=40, prompt=3_000_000, completion=3_000_000)
    line.records_succeeded = 40
    line.save()
    for adapter, name, records, tokens in ((alpha, "alpha@1", 10, 1_000_000), (beta, "beta@1", 30, 2_000_000)):
        JobAdapterUsage.objects.create(
            usage=line,
            adapter=adapter,
            name=name,
            records_succeeded=records,
            prompt_tokens=tokens,
            completion_tokens=tokens,
        )
    # alpha: 10/40 of 40 s at 2 + 1 M in at 10 + 1 M out at 20 = 50; beta, at the base model's price
    # (it has none of its own): 30 s at 1 + 2 M at 1 + 2 M at 1 = 34.
    assert _cost(line) == Decimal("84.00")


def _month_of_ledger(minilm: Any) -> tuple[Any, Any]:
    other = ModelFactory(name="other-embedder", is_default=False)
    price(minilm, per_gpu_second="0.0003", per_million_input_tokens="0.37")
    price(other, per_gpu_second="0.0007", per_million_output_tokens="1.13")
    teams = [TenantFactory(name=f"team-{n}") for n in range(3)]
    for n, team in enumerate(teams):
        for k in range(4):
            # Odd amounts, so that each line rounds: the chargeback must still add up to the ledger.
            ledger_line(team, minilm, recorded_at=NOV_10, gpu_seconds=12.345 * (n + k + 1), prompt=7_777 * (k + 1))
            ledger_line(team, other, recorded_at=NOV_20, gpu_seconds=3.21 * (k + 1), completion=55_555 * (n + 1))
    ledger_line(teams[0], minilm, recorded_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC), gpu_seconds=1e6)
    return teams, other


def test_the_chargeback_csv_of_a_month_has_a_row_per_tenant_and_model_and_sums_to_the_ledger(minilm: Any) -> None:
    _month_of_ledger(minilm)
    out = io.StringIO()
    call_command("chargeback", "--month", "2026-11", stdout=out, stderr=io.StringIO())
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert list(rows[0]) == COLUMNS
    assert [(row["tenant"], row["model"]) for row in rows] == [
        (f"team-{n}", model) for n in range(3) for model in sorted([str(minilm), "other-embedder@1"])
    ]
    assert {row["month"] for row in rows} == {"2026-11"} and {row["currency"] for row in rows} == {"USD"}
    november = JobUsage.objects.filter(period=dt.date(2026, 11, 1))
    ledger = sum(usage_costs(november.select_related("model").prefetch_related("adapters")).values(), Decimal(0))
    assert sum(Decimal(row["cost"]) for row in rows) == ledger > 0
    assert sum(int(row["jobs"]) for row in rows) == november.count() == 24


def test_a_chargeback_month_must_be_written_yyyy_mm(db: None) -> None:
    with pytest.raises(CommandError, match="YYYY-MM"):
        call_command("chargeback", "--month", "November")


def test_operators_download_the_chargeback_from_the_admin_and_others_cannot(
    client: Any, admin_user: Any, minilm: Any
) -> None:
    _month_of_ledger(minilm)
    url = "/admin/jobs/jobusage/chargeback.csv?month=2026-11"
    client.force_login(UserFactory(username="a-tenant-member"))
    assert client.get(url).status_code == 302  # to the admin's sign-in
    client.force_login(admin_user)
    response = client.get(url)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert 'filename="chargeback-2026-11.csv"' in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert len(rows) == 6
    assert client.get("/admin/jobs/jobusage/chargeback.csv?month=11-2026").status_code == 400


def test_a_line_keeps_the_cost_it_was_written_with_whatever_prices_are_deleted_later(acme: Any, minilm: Any) -> None:
    priced = price(minilm, per_gpu_second="0.01")
    line = ledger_line(acme, minilm, recorded_at=NOV_10, gpu_seconds=100)
    assert _cost(line) == Decimal("1.00")
    Price.objects.filter(pk=priced.pk).delete()
    price(minilm, per_gpu_second="5", effective_from=dt.date(2026, 11, 1))
    assert _cost(line) == Decimal("1.00")
    assert cost_per_month(JobUsage.objects.filter(tenant=acme))[dt.date(2026, 11, 1)].cost == Decimal("1.00")


def test_a_model_or_gpu_class_with_prices_cannot_be_deleted_and_a_deleted_adapter_leaves_past_chargeback(
    acme: Any,
) -> None:
    base = ModelFactory(name="base-llm", is_default=False)
    alpha = Adapter.objects.create(name="alpha", base_model=base, owner=acme, source="/x", rank=4)
    price(base, per_gpu_second="1")
    price(base, adapter=alpha, per_gpu_second="3")
    line = ledger_line(acme, base, recorded_at=NOV_10, gpu_seconds=10)
    JobAdapterUsage.objects.create(usage=line, adapter=alpha, name="alpha@1", records_succeeded=10)
    before = _chargeback("2026-11")
    with pytest.raises(ProtectedError):
        alpha.delete()
    with pytest.raises(ProtectedError):
        base.delete()
    with pytest.raises(ProtectedError):
        base.gpu_class.delete()

    alpha_pk = alpha.pk
    adapter_delete(alpha, tenant=acme, actor=None)

    assert not Price.objects.filter(adapter=alpha_pk).exists() and Price.objects.filter(model=base).count() == 1
    assert _chargeback("2026-11") == before
    assert [row["cost"] for row in before] == ["30.00"]


def test_a_job_with_a_ledger_line_cannot_be_deleted(acme: Any, minilm: Any) -> None:
    line = ledger_line(acme, minilm, recorded_at=NOV_10, gpu_seconds=1)
    with pytest.raises(ProtectedError):
        line.job.delete()


def test_the_usage_record_prices_the_line_when_the_job_ends(acme: Any, minilm: Any) -> None:
    price(minilm, per_gpu_second="0.5")
    job = Job.objects.create(
        tenant=acme, model=minilm, status=JobStatus.SUCCEEDED, input_uri="file:///x.jsonl", finished_at=NOV_10
    )
    Shard.objects.create(
        job=job, index=0, first_record=0, record_count=1, input_uri="file:///s", status="succeeded", compute_seconds=4.0
    )
    job = Job.objects.select_related("model", "tenant").get(pk=job.pk)
    usage_record(job=job)
    assert JobUsage.objects.get(job=job).cost == Decimal("2.00")


def test_the_months_of_the_usage_api_are_summed_in_one_grouped_read(
    acme: Any, minilm: Any, django_assert_max_num_queries: Any
) -> None:
    price(minilm, per_gpu_second="1")
    for day in range(1, 29):
        ledger_line(acme, minilm, recorded_at=dt.datetime(2026, 10, day, tzinfo=dt.UTC), gpu_seconds=1)
    cost_per_month(JobUsage.objects.filter(tenant=acme))  # the old lines are priced once, and kept
    with django_assert_max_num_queries(2):
        months = cost_per_month(JobUsage.objects.filter(tenant=acme))
    assert months[dt.date(2026, 10, 1)].cost == Decimal("28.00")


def _chargeback(month: str) -> list[dict[str, str]]:
    out = io.StringIO()
    call_command("chargeback", "--month", month, stdout=out, stderr=io.StringIO())
    return list(csv.DictReader(io.StringIO(out.getvalue())))
