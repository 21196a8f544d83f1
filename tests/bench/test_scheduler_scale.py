"""`bench.scheduler_scale` at a small size: its ticks run against its slots' heartbeats and send shards."""

from __future__ import annotations

import pytest

from bench.scheduler_scale import GPU_CLASS, render_scheduler, run_scheduler_bench
from portal.jobs.models import Job, Shard


@pytest.mark.django_db(transaction=True)
def test_the_scheduler_bench_times_full_and_sending_ticks_and_cleans_up() -> None:
    figures = run_scheduler_bench(tenants=3, jobs=6, waiting_per_job=4, slots=2, ticks=3)

    assert (figures.jobs, figures.waiting_shards, figures.slots) == (6, 24, 2)
    assert len(figures.full_ms) == len(figures.one_free_ms) == 3
    # Two slots: a window of four, filled by the rows the bench made; each shard ended frees one place.
    assert (figures.sent_when_full, figures.sent_when_free) == (0, 3)
    assert not Job.objects.filter(model__gpu_class__name=GPU_CLASS).exists()
    assert not Shard.objects.exists()
    assert "one place free" in render_scheduler(figures)
