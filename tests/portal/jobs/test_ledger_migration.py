"""jobs 0021: the ledger's one line per job becomes one line per ending; each line there was becomes its
job's round-0 line, as it was, with its adapter splits."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from portal.jobs.models import Job, JobAdapterUsage, JobStatus, JobUsage

BEFORE = [("jobs", "0020_ledger_cost_kept_job_protected")]
AFTER = [("jobs", "0021_ledger_line_per_ending")]
NOV_10 = dt.datetime(2026, 11, 10, 12, tzinfo=dt.UTC)


def _migrate(targets: list[tuple[str, str]]) -> Any:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_each_line_there_was_becomes_its_job_s_round_0_line_with_its_adapter_splits(acme: Any, minilm: Any) -> None:
    jobs = [
        Job.objects.create(tenant=acme, model=minilm, status=JobStatus.SUCCEEDED, input_uri="file:///x.jsonl")
        for _ in range(2)
    ]
    old = _migrate(BEFORE)
    try:
        lines = old.get_model("jobs", "JobUsage")
        splits = old.get_model("jobs", "JobAdapterUsage")
        for n, job in enumerate(jobs):
            line = lines.objects.create(
                job_id=job.pk,
                tenant_id=acme.pk,
                model_id=minilm.pk,
                period=dt.date(2026, 11, 1),
                status=JobStatus.SUCCEEDED,
                records_succeeded=10 + n,
                prompt_tokens=100 + n,
                gpu_seconds=1.5 + n,
                recorded_at=NOV_10,
                cost=Decimal("2.50") + n,
            )
            splits.objects.create(usage=line, name=f"bot@{n}", records_succeeded=10 + n)
    finally:
        _migrate(AFTER)
        _migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())

    for n, job in enumerate(jobs):
        line = JobUsage.objects.get(job=job)
        assert (line.round, line.period, line.recorded_at) == (0, dt.date(2026, 11, 1), NOV_10)
        assert (line.records_succeeded, line.prompt_tokens, line.gpu_seconds) == (10 + n, 100 + n, 1.5 + n)
        assert line.cost == Decimal("2.50") + n, "a kept cost is copied, never re-priced"
        (split,) = JobAdapterUsage.objects.filter(usage=line)
        assert (split.name, split.records_succeeded) == (f"bot@{n}", 10 + n)
