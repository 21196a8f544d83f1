"""Attacks on the bills and the budget: a deleted adapter that would re-price past months, retries past
the tenant's quota and budget, a job run past its budget, a ledger read priced whole on every request, and
a retry in a later month that would move a job's bill out of the month it ended in."""

from __future__ import annotations

import datetime as dt
import io
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import orjson
import pytest
from django.utils import timezone

from tests.abuse.conftest import scale
from tests.support.abuse import MODEL, AbuseResult, AbuseStack, TenantAccess

pytestmark = [pytest.mark.slow, pytest.mark.abuse]

LAST_MONTH = (timezone.now().replace(day=1) - dt.timedelta(days=1)).replace(hour=12)


def _tenant(name: str) -> Any:
    from portal.tenancy.models import Tenant

    return Tenant.objects.get(name=name)


def _ended_with_failures(access: TenantAccess) -> str:
    """A job of the tenant that ended partially succeeded with failed records (rows only: the retry's request
    reads no file, and is refused before any round is cut)."""
    from portal.catalog.models import Model
    from portal.jobs.models import Job, JobStatus, Shard

    job = Job.objects.create(
        tenant=_tenant(access.name),
        model=Model.objects.get(name=MODEL),
        status=JobStatus.PARTIALLY_SUCCEEDED,
        input_uri="file:///nowhere.jsonl",
        total_records=10,
        succeeded_records=6,
        failed_records=4,
        shard_count=1,
        finished_at=timezone.now(),
    )
    Shard.objects.create(job=job, index=0, first_record=0, record_count=10, input_uri="file:///s", prefix_uri="p")
    return str(job.pk)


def _chargeback(month: dt.date) -> list[Any]:
    from portal.jobs.chargeback import chargeback_rows

    return chargeback_rows(month=month)


def test_deleting_a_priced_adapter_never_changes_a_past_months_chargeback(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("adapter-deleter")
    with abuse_stack.db():
        from portal.audit.models import AuditEntry
        from portal.catalog.models import Adapter, Model
        from portal.catalog.services import PRICE_CHANGED
        from portal.jobs.models import JobAdapterUsage
        from tests.factories import ModelFactory
        from tests.support.ledger import ledger_line, price

        base = ModelFactory(
            name="abuse-lora-base",
            engine=Model.Engine.VLLM,
            task=Model.Task.CHAT,
            source="/nowhere",
            load_params={"enable_lora": True},
            is_default=False,
        )
        adapter = Adapter.objects.create(
            name="priced", base_model=base, owner=_tenant(attacker.name), source="/nowhere-lora", rank=4
        )
        price(base, per_gpu_second="1", effective_from=LAST_MONTH.date().replace(day=1))
        price(base, adapter=adapter, per_gpu_second="5", effective_from=LAST_MONTH.date().replace(day=1))
        line = ledger_line(_tenant(attacker.name), base, recorded_at=LAST_MONTH, gpu_seconds=100)
        JobAdapterUsage.objects.create(usage=line, adapter=adapter, name="priced@1", records_succeeded=10)
        month = LAST_MONTH.date().replace(day=1)
        before = _chargeback(month)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            answer = client.delete(f"/api/v1/adapters/{adapter.pk}/")
            assert answer.status_code == 204, answer.text
            again = client.delete(f"/api/v1/adapters/{adapter.pk}/")
            assert again.status_code == 404, again.text
        with abuse_stack.db():
            after = _chargeback(month)
            assert after == before and [row.cost for row in after] == [Decimal("500.00")], after
            assert not Adapter.objects.filter(pk=adapter.pk).exists()
            assert AuditEntry.objects.filter(action=PRICE_CHANGED, target_type="catalog.price").exists()
        return "the priced adapter deleted (204), its price audited; last month's chargeback unchanged (500.00)"

    abuse_report("delete a priced adapter to re-price past months", attack)


def test_retries_past_the_tenants_jobs_queued_records_and_budget_are_refused_with_429(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("retry-attacker", max_concurrent_jobs=1)
    with abuse_stack.db():
        from portal.catalog.models import Model
        from portal.jobs.models import Job
        from portal.tenancy.models import BudgetHold, Quota

        ended = [_ended_with_failures(attacker) for _ in range(3)]
        Job.objects.create(
            tenant=_tenant(attacker.name), model=Model.objects.get(name=MODEL), input_uri="file:///queued.jsonl"
        )
    rounds = scale(5, 20)

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            for _ in range(rounds):
                for job_id in ended:
                    answer = client.post(f"/api/v1/jobs/{job_id}/retry/")
                    assert answer.status_code == 429, answer.text
                    assert answer.json()["error"]["param"] == "max_concurrent_jobs", answer.text
            with abuse_stack.db():
                Quota.objects.filter(tenant__name=attacker.name).update(
                    max_concurrent_jobs=None, monthly_budget=Decimal("0.50")
                )
                for job_id in ended:
                    BudgetHold.objects.update_or_create(
                        job_id=job_id, defaults={"tenant": _tenant(attacker.name), "amount": Decimal(10)}
                    )
            for job_id in ended:
                answer = client.post(f"/api/v1/jobs/{job_id}/retry/")
                assert answer.status_code == 429, answer.text
                assert answer.json()["error"]["param"] == "monthly_budget", answer.text
        with abuse_stack.db():
            assert set(Job.objects.filter(pk__in=ended).values_list("retry_round", flat=True)) == {0}
        return f"{rounds * len(ended)} retries past max_concurrent_jobs, then past the budget: 429, no round started"

    abuse_report("retry ended jobs past the quota and budget", attack)


def test_a_job_run_past_its_budget_stops_with_its_finished_work_kept(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("budget-runner")
    with abuse_stack.db():
        from portal.catalog.models import Model
        from tests.support.ledger import price

        # Dear enough that the first shard's seconds pass the budget set below; removed after the attack, so
        # that no other tenant's budget meets it.
        dear = price(Model.objects.get(name=MODEL), per_gpu_second="1000", effective_from=timezone.now().date())
    records = scale(400, 2000)
    body = b"".join(orjson.dumps({"custom_id": f"b{n}", "input": f"budget {n}"}) + b"\n" for n in range(records))

    def attack() -> str:
        from portal.tenancy.models import Quota

        with abuse_stack.api(attacker) as client:
            created = client.post(
                "/api/v1/jobs/",
                data={"model": MODEL, "shard_size": "20"},
                files={"file": ("b.jsonl", io.BytesIO(body))},
            )
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            # The budget lowered under the running job (an operator's change, or other jobs' spend).
            with abuse_stack.db():
                Quota.objects.filter(tenant__name=attacker.name).update(monthly_budget=Decimal("0.01"))
            deadline = time.monotonic() + 60
            while (job := client.get(f"/api/v1/jobs/{job_id}/").json())["status"] not in (
                "partially_succeeded",
                "failed",
                "succeeded",
            ):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            output = client.get(f"/api/v1/jobs/{job_id}/output/", follow_redirects=True)
        assert job["status"] == "partially_succeeded" and "budget_exceeded" in job["error"], job
        lines = [orjson.loads(line) for line in output.content.splitlines()]
        kept = sum("response" in line for line in lines)
        stopped = sum(line.get("error", {}).get("code") == "budget_exceeded" for line in lines)
        assert len(lines) == records and kept > 0 and stopped > 0, (kept, stopped)
        return f"stopped at the budget: partially_succeeded, {kept} records kept, {stopped} budget_exceeded"

    try:
        abuse_report("run a job past the monthly budget", attack)
    finally:
        with abuse_stack.db():
            dear.delete()


def test_reading_the_months_of_a_large_ledger_stays_cheap(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("ledger-reader")
    lines = scale(2_000, 20_000)
    with abuse_stack.db():
        from portal.catalog.models import Model
        from portal.jobs.models import Job, JobStatus, JobUsage

        model = Model.objects.get(name=MODEL)
        tenant = _tenant(attacker.name)
        jobs = Job.objects.bulk_create(
            Job(tenant=tenant, model=model, status=JobStatus.SUCCEEDED, input_uri="file:///l.jsonl")
            for _ in range(lines)
        )
        JobUsage.objects.bulk_create(
            JobUsage(
                job=job,
                tenant=tenant,
                model=model,
                period=LAST_MONTH.date().replace(day=1),
                status=JobStatus.SUCCEEDED,
                records_succeeded=1,
                gpu_seconds=1.0,
                recorded_at=LAST_MONTH,
                cost=Decimal("0.01"),
            )
            for job in jobs
        )
    reads = scale(20, 100)

    def attack() -> str:
        slowest = 0.0
        with abuse_stack.api(attacker) as client:
            for _ in range(reads):
                started = time.monotonic()
                answer = client.get("/api/v1/usage/periods/")
                slowest = max(slowest, time.monotonic() - started)
                assert answer.status_code == 200, answer.text
                (month,) = answer.json()
                assert month["jobs"] == lines and month["cost"]["amount"] == f"{lines * Decimal('0.01'):.2f}"
        assert slowest < 2.0, slowest
        return f"{reads} reads of {lines:,} ledger lines' months: 200, slowest {slowest:.2f} s (kept costs summed)"

    abuse_report("read the months of a large ledger", attack)


def test_a_job_retried_in_a_later_month_never_changes_last_months_chargeback(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("late-retrier")
    month = LAST_MONTH.date().replace(day=1)
    root = abuse_stack.storage_root / "late-retrier" / "job"
    (root / "input").mkdir(parents=True, exist_ok=True)
    ids = [f"late-{n}" for n in range(10)]
    failed = ids[6:]
    (root / "input" / "shard-00000.jsonl").write_bytes(
        b"".join(orjson.dumps({"custom_id": cid, "input": f"late {cid}"}) + b"\n" for cid in ids)
    )
    error = {"code": "engine_error", "message": "failed in the first round"}
    lines = {
        cid: orjson.dumps({"custom_id": cid, "error": error} if cid in failed else {"custom_id": cid}) for cid in ids
    }
    (root / "output.jsonl").write_bytes(b"".join(lines[cid] + b"\n" for cid in ids))
    (root / "errors.jsonl").write_bytes(b"".join(lines[cid] + b"\n" for cid in failed))
    with abuse_stack.db():
        from portal.catalog.models import Model
        from portal.jobs.models import Job, JobStatus, JobUsage, Shard
        from portal.jobs.transitions import job_transition
        from tests.support.ledger import price

        model = Model.objects.get(name=MODEL)
        # Last month's price, then a dearer one from today: the retry must not re-price last month's line.
        prices = [
            price(model, per_gpu_second="1", effective_from=month),
            price(model, per_gpu_second="3", effective_from=timezone.now().date()),
        ]
        job = Job.objects.create(
            tenant=_tenant(attacker.name),
            model=model,
            status=JobStatus.MERGING,
            input_uri=(root / "input.jsonl").as_uri(),
            output_uri=(root / "output.jsonl").as_uri(),
            errors_uri=(root / "errors.jsonl").as_uri(),
            total_records=10,
            shard_count=1,
        )
        Shard.objects.create(
            job=job,
            index=0,
            first_record=0,
            record_count=10,
            input_uri=(root / "input" / "shard-00000.jsonl").as_uri(),
            prefix_uri=(root / "attempts" / "shard-00000").as_uri(),
            status="succeeded",
            succeeded_records=6,
            failed_records=4,
            compute_seconds=5.0,
            load_seconds=0.0,
        )
        # Its first ending, on the last day of last month, writes its line there as every ending does.
        assert job_transition(
            job_id=str(job.pk),
            source=JobStatus.MERGING,
            target=JobStatus.PARTIALLY_SUCCEEDED,
            succeeded_records=6,
            failed_records=4,
            finished_at=LAST_MONTH,
        )
        first = JobUsage.objects.get(job=job)
        before = _chargeback(month)
        assert first.cost == Decimal(5) * model.gpus_per_replica, first.cost

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            answer = client.post(f"/api/v1/jobs/{job.pk}/retry/")
            assert answer.status_code == 200, answer.text
            deadline = time.monotonic() + 60
            while (ended := client.get(f"/api/v1/jobs/{job.pk}/").json())["status"] not in (
                "succeeded",
                "partially_succeeded",
                "failed",
            ):
                assert time.monotonic() < deadline, ended
                time.sleep(0.2)
        with abuse_stack.db():
            from django.db import connection

            try:
                assert _chargeback(month) == before
                kept, retried = JobUsage.objects.filter(job=job).order_by("round")
                assert (kept.period, kept.cost, kept.gpu_seconds) == (month, first.cost, first.gpu_seconds)
                assert retried.round == 1 and retried.period == timezone.now().date().replace(day=1), retried
            finally:
                # This thread's own connection, which would otherwise outlive the test database's teardown.
                connection.close()
        return f"the retry ({ended['status']}) added a line to this month; last month's chargeback unchanged"

    try:
        abuse_report("retry a job in a later month to move its bill", attack)
    finally:
        with abuse_stack.db():
            for made in prices:
                made.delete()
