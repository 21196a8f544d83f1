"""Shards cut by cost with real workers: on records whose lengths vary tenfold, shards take about
equally long once the model's throughput is learned; shards cut by count do not. And a dry run,
once the model has run, estimates the real run's GPU-seconds."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings

from portal.catalog.models import Model
from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.services.dry_run import job_dry_run
from portal.tenancy.models import Tenant
from tests.execution.conftest import ended, report
from tests.factories import ModelFactory
from tests.support.chaos import ChaosStack, check_exactly_once, write_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

# 0.2 ms a record plus 10 µs a character: a 30-character record costs 0.5 ms, a 300-character one 3.2 ms.
PARAMS = {"sleep_per_record": 0.0002, "sleep_per_char": 0.00001}


RUN = 1500


def _texts(count: int) -> list[str]:
    """Runs of 1,500 short (30 characters) and 1,500 long (300 characters) records: longer than a
    shard, as in a dataset sorted by source, so that shards cut by count differ in cost."""
    return ["s" * 30 if (n // RUN) % 2 == 0 else "L" * 300 for n in range(count)]


def _input(tmp_path: Path, name: str) -> tuple[Path, list[str]]:
    path = tmp_path / f"{name}.jsonl"
    return path, write_records(path, _texts(6000))


def _run(sim: ChaosStack, tmp_path: Path, name: str, shard_size: int | None) -> Job:
    path, ids = _input(tmp_path, name)
    job = ended(sim.submit(model="costed-echo", input_path=path, shard_size=shard_size, tenant="cost"), sim)
    check_exactly_once(name, job, ids, 0)
    return job


def _cv(job: Job, *, skip_first: int = 0) -> float:
    # The last shard holds the remainder; it is left out of both figures.
    seconds = [s.compute_seconds for s in job.shards.order_by("index")][skip_first:-1]
    return statistics.pstdev(seconds) / statistics.mean(seconds)


def _slow_start_shards(target_seconds: float) -> int:
    """The first shards of a job cut by cost, cut short on purpose so its first results come at once."""
    first = django_settings.BATCHERY_FIRST_SHARD_SECONDS
    return sum(1 for n in range(64) if first and first * 2**n < target_seconds)


def test_cost_cut_shards_take_about_equally_long_where_count_cut_shards_do_not(
    sim: ChaosStack, tmp_path: Path, settings: Any
) -> None:
    settings.BATCHERY_TARGET_SHARD_SECONDS = 1  # as the stack's workers have it
    ModelFactory(
        name="costed-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.CLASSIFY,
        source="tests.support.chaos_engines:echo_factory",
        default_params={**PARAMS, "time_limit_base_s": 60, "time_limit_per_record_s": 0.01},
        is_default=False,
    )
    learning = _run(sim, tmp_path, "learning the throughput", shard_size=150)
    # The dry run of the next job, from what the first one taught the model's throughput estimate.
    estimate = job_dry_run(
        tenant=Tenant.objects.get(name="cost"),
        request=JobRequest(model_name="costed-echo", input_uri=str(_input(tmp_path, "cut by cost")[0])),
    )
    by_cost = _run(sim, tmp_path, "cut by cost", shard_size=None)
    real_gpu_seconds = sum(shard.compute_seconds for shard in by_cost.shards.all())
    by_count = _run(sim, tmp_path, "cut by count", shard_size=by_cost.total_records // by_cost.shard_count)
    report(
        f"6,000 records in runs of {RUN:,} of 30 and 300 characters (1 s shards)",
        [
            (
                "shard durations' coefficient of variation, cut by cost (after the slow start)",
                f"{_cv(by_cost, skip_first=_slow_start_shards(target_seconds=1)):.3f} ({by_cost.shard_count})",
            ),
            (
                "shard durations' coefficient of variation, cut by count",
                f"{_cv(by_count):.3f} ({by_count.shard_count})",
            ),
            ("learned from", f"{learning.shard_count} shards"),
            (
                "dry run's estimate / the run's GPU-seconds",
                f"{estimate.estimated_gpu_seconds:.2f} / {real_gpu_seconds:.2f}",
            ),
        ],
    )
    assert estimate.observed
    assert estimate.shards.count == by_cost.shard_count
    assert estimate.estimated_gpu_seconds == pytest.approx(real_gpu_seconds, rel=0.25)
    slow_start = _slow_start_shards(target_seconds=1)
    assert _cv(by_cost, skip_first=slow_start) < 0.25
    assert _cv(by_count) > _cv(by_cost, skip_first=slow_start)
