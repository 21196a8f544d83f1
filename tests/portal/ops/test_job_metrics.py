"""A job's ending adds to the control side's counters and histograms, once, in its own transaction."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.transitions import job_transition
from portal.ops.metrics.collector import stored_families

pytestmark = pytest.mark.django_db


def _values() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in stored_families()
        for sample in family.samples
    }


def _merging_job(acme: Any, minilm: Any) -> Job:
    created = timezone.now() - dt.timedelta(seconds=40)
    job = Job.objects.create(
        tenant=acme, model=minilm, status=JobStatus.MERGING, input_uri="file:///in.jsonl", shard_size=10
    )
    Job.objects.filter(pk=job.pk).update(created_at=created)
    for index, (succeeded, codes) in enumerate([(10, {}), (7, {"engine_error": 2, "poison_record": 1})]):
        Shard.objects.create(
            job=job, index=index, first_record=index * 10, record_count=10, input_uri="x", prefix_uri="y",
            succeeded_records=succeeded, failed_records=10 - succeeded, error_codes=codes,
            started_at=created + dt.timedelta(seconds=3 + index), compute_seconds=4.0, load_seconds=1.0,
        )  # fmt: skip
    return job


def test_an_ending_counts_the_job_its_records_by_outcome_its_times_and_gpu_seconds(acme: Any, minilm: Any) -> None:
    job = _merging_job(acme, minilm)
    ended = job_transition(
        job_id=str(job.id), source=JobStatus.MERGING, target=JobStatus.PARTIALLY_SUCCEEDED,
        succeeded_records=17, failed_records=3, finished_at=timezone.now(),
    )  # fmt: skip
    assert ended
    values = _values()
    labels = (("model", "all-MiniLM-L6-v2"), ("tenant", "acme"))

    def value(name: str, **extra: str) -> float:
        return values[(name, tuple(sorted((*labels, *extra.items()))))]

    assert value("batchery_jobs_finished_total", status="partially_succeeded") == 1
    assert value("batchery_records_finished_total", outcome="succeeded") == 17
    assert value("batchery_records_finished_total", outcome="engine_error") == 2
    assert value("batchery_records_finished_total", outcome="poison_record") == 1
    assert value("batchery_poison_records_total") == 1
    assert value("batchery_gpu_seconds_total", gpu_class="cpu") == pytest.approx(10.0)
    assert value("batchery_job_duration_seconds_count") == 1
    assert value("batchery_job_duration_seconds_bucket", le="30.0") == 0
    assert value("batchery_job_duration_seconds_bucket", le="60.0") == 1
    assert value("batchery_job_queue_wait_seconds_sum") == pytest.approx(3.0, abs=0.01)
    assert value("batchery_job_queue_wait_seconds_bucket", le="+Inf") == 1

    # A second move to an ending is refused, and counts nothing.
    assert not job_transition(job_id=str(job.id), source=JobStatus.MERGING, target=JobStatus.SUCCEEDED)
    assert _values() == values
