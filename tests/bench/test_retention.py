"""`bench.retention` at a small size: it writes settled shard rows, measures them, and sweeps them all."""

from __future__ import annotations

import pytest

from bench.retention import render_retention, run_retention_bench
from portal.jobs.models import Job, Shard


@pytest.mark.django_db(transaction=True)  # VACUUM runs outside a transaction
def test_the_retention_bench_measures_its_rows_and_sweeps_them_all() -> None:
    figures = run_retention_bench(shards=300, jobs=3, say=lambda line: None)

    assert (figures.shards, figures.events) == (300, 15)
    assert (figures.removed_shards, figures.removed_events) == (300, 15)
    assert figures.grown["shards"].heap > 300 * 500  # URIs, ids, the worker: a settled row is large
    assert "jobs_job" in figures.due_plan
    assert not Shard.objects.exists() and not Job.objects.filter(tenant__name="bench-retention").exists()
    assert "shards: total per million" in render_retention(figures)
