"""The planning and merging benchmark at tiny sizes: real child processes on the test database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from bench.plan_merge import MB, IoBenchError, bench_input, render_io_results, run_io_bench
from portal.devstack.embedded import free_port
from portal.jobs.models import Job, JobStatus
from portal.jobs.storage_layout import job_prefix
from tasks.shared.storage import store_for
from tests.support.workers import database_url


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_io_bench_plans_and_merges_each_size_in_its_own_process(minilm: Any) -> None:
    # The children read the database from the environment; the test database is not the configured one.
    child_env = {"DATABASE_URL": database_url(connection.settings_dict)}

    results = run_io_bench([2, 6], shard_size=2_000, child_env=child_env)

    assert [r.size_mb for r in results] == [2, 6]
    for result in results:
        assert 0 <= result.input_bytes - result.size_mb * MB < 4096
        assert result.records > 0
        assert result.shards == -(-result.records // 2_000)
        assert result.plan_mb_s > 0 and result.merge_mb_s > 0
        for step in (result.plan, result.merge):
            assert 0 < step.start_rss_bytes <= step.peak_rss_bytes
        # The scheduler sends what the queue's window holds (no slot heartbeats here: the default).
        assert result.plan.published == min(result.shards, settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW)
        assert result.merge.published == 0
        assert result.output_lines == result.records
        job = Job.objects.get(pk=result.job_id)
        assert job.status == JobStatus.SUCCEEDED
        assert (job.total_records, job.succeeded_records, job.failed_records) == (result.records, result.records, 0)
        assert sum(job.shards.values_list("prompt_tokens", flat=True)) > 0
        root = job_prefix(result.job_id)
        assert not list(store_for(root).list_prefix(root)), "the job's storage was removed"
    assert results[1].records > 2 * results[0].records

    table = render_io_results(results)
    assert "plan peak RSS MB" in table and "merge peak RSS MB" in table
    assert "peak RSS, 6 MB input / 2 MB input" in table


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_io_bench_children_use_no_broker_of_the_environment(minilm: Any) -> None:
    # `make bench` once left a stopped Redis's address in the environment; the planning child sent
    # its chords there and died. Its chords now go to an in-memory broker, counted, never queued.
    stopped = f"redis://127.0.0.1:{free_port()}/0"
    child_env = {
        "DATABASE_URL": database_url(connection.settings_dict),
        "CELERY_BROKER_URL": stopped,
        "CELERY_RESULT_BACKEND": stopped,
    }

    [result] = run_io_bench([1], shard_size=2_000, child_env=child_env)

    assert result.plan.published == min(result.shards, settings.BATCHERY_SCHEDULER_DEFAULT_WINDOW) > 0
    assert result.output_lines == result.records


@pytest.mark.django_db(transaction=True)
def test_a_failed_io_bench_leaves_no_job_to_resume(minilm: Any) -> None:
    # The planning child cannot reach its database: the step fails, and its job must not stay queued
    # for a later stack's reconciler to plan and run.
    unreachable = {"DATABASE_URL": f"postgres://postgres@127.0.0.1:{free_port()}/nowhere"}

    with pytest.raises(IoBenchError, match="the plan process failed"):
        run_io_bench([1], shard_size=2_000, child_env=unreachable)

    assert not Job.objects.exists()


def test_a_bench_input_of_the_right_size_is_reused(tmp_path: Path) -> None:
    path = bench_input(1, tmp_path)
    written = path.stat().st_mtime_ns
    lines = path.read_bytes().splitlines()
    assert lines[0].startswith(b'{"custom_id":"rec-0000000000","input":"')
    assert len({line.split(b'"input":')[1] for line in lines}) > 1000, "the texts vary"

    assert bench_input(1, tmp_path) == path
    assert path.stat().st_mtime_ns == written
