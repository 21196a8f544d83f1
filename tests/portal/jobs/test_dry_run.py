"""The dry run: what a submission would do (records, tokens, shards, cost, ETA, quota) and that it
stores nothing; its shards are the planner's, and its estimate learns from finished shards."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from portal.catalog.models import Model
from portal.catalog.throughput import throughput_observe
from portal.execution import capacity
from portal.execution.dispatch import job_queue
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobEvent, JobStatus, Shard, ShardStatus
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.dry_run import DryRunReport, eta_seconds, job_dry_run
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Quota, Tenant
from tasks.shared.config import broker_url
from tests.factories import ModelFactory, TenantFactory

SHORT = "hello hello hello"  # 3 words and [CLS] [SEP]: 5 tokens
LONG = " ".join(["hello"] * 20)  # 22 tokens
LONG_LINES = (5, 17, 29)


@pytest.fixture
def two_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two live slots on every queue, for the planner and the dry run alike."""
    monkeypatch.setattr(capacity, "live_slots", lambda queue: 2)


def _storage_files() -> list[str]:
    root = Path(settings.BATCHERY_STORAGE_URL.removeprefix("file://"))
    return sorted(str(path) for path in root.rglob("*") if path.is_file()) if root.exists() else []


def _broker() -> dict[str, int]:
    """Every key of the broker's database, with the length of each list (the queues)."""
    client = redis.Redis.from_url(broker_url())
    return {key.decode(): client.llen(key) if client.type(key) == b"list" else 0 for key in client.keys("*")}


def _running_job(tenant: Tenant, model: Model, shards: list[tuple[str, float | None, int]], records: int) -> Job:
    """A running job with shards (status, estimated seconds, records), made directly in the database."""
    job_id = uuid.uuid4()
    job = Job.objects.create(
        id=job_id,
        tenant=tenant,
        model=model,
        status=JobStatus.RUNNING,
        input_uri="file:///data/input.jsonl",
        total_records=records,
        shard_count=len(shards),
        output_uri=f"file:///nowhere/{job_id}/output.jsonl",
        errors_uri=f"file:///nowhere/{job_id}/errors.jsonl",
        started_at=timezone.now(),
    )
    for index, (status, seconds, count) in enumerate(shards):
        Shard.objects.create(
            job=job,
            index=index,
            first_record=0,
            record_count=count,
            estimated_seconds=seconds,
            status=status,
            input_uri=f"file:///nowhere/{job_id}/{index}",
            prefix_uri=f"file:///nowhere/{job_id}/{index}/",
        )
    return job


def test_a_dry_run_reports_tokens_over_length_lines_shards_eta_and_quota_and_stores_nothing(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path], settings: Any, two_slots: None
) -> None:
    settings.BATCHERY_MIN_SHARD_SECONDS = 0.5
    settings.BATCHERY_FIRST_SHARD_SECONDS = 0  # no slow start: the shards below are all cut at the target
    minilm.load_params = {"max_seq_length": 16}
    minilm.gpus_per_replica = 2
    minilm.save()
    texts = [LONG if line in LONG_LINES else SHORT for line in range(1, 31)]
    path = write_jsonl([{"custom_id": f"r{n}", "input": text} for n, text in enumerate(texts)])
    # The queue's backlog: globex (weight 3) has 45 s waiting or running, acme 3 s of its own.
    globex = TenantFactory(name="globex", weight=3.0)
    _running_job(
        globex,
        minilm,
        [
            (ShardStatus.PENDING, 20.0, 400),
            (ShardStatus.PENDING, 20.0, 400),
            (ShardStatus.DISPATCHED, None, 100),  # not costed: 100 records at the default 0.05 s
            (ShardStatus.SUCCEEDED, 50.0, 1000),  # done: no longer in the way
        ],
        records=1900,
    )
    _running_job(acme, minilm, [(ShardStatus.PENDING, 3.0, 80)], records=80)
    Quota.objects.filter(tenant=acme).update(
        max_concurrent_jobs=2, max_queued_records=100, max_input_bytes=10_000_000, gpu_seconds_per_month=1000
    )

    with _nothing_stored():
        report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))

    assert (report.records, report.problem_count, report.problems, report.rejected) == (30, 0, (), None)
    assert report.input_tokens == 27 * 5 + 3 * 22
    assert report.over_length is not None
    assert (report.over_length.max_tokens, report.over_length.count, report.over_length.lines) == (16, 3, LONG_LINES)
    # 30 records at the default 0.05 s: 1.5 s. The backlog holds both slots: with no slot to spread over,
    # the job is one shard at the target, not shrinking ones (0.75 s, 0.5 s, 0.25 s on one spare slot).
    assert report.shards.count == 1
    assert [(shard.records, shard.seconds) for shard in report.shards.listed] == [(30, pytest.approx(1.5))]
    assert report.estimated_seconds == pytest.approx(1.5)
    assert report.estimated_gpu_seconds == pytest.approx(3.0), "two GPUs a replica"
    assert report.observed is False
    assert (report.queue, report.slots) == ("gpu.cpu.x2", 2)
    assert report.backlog_seconds == pytest.approx(3.0 + 45.0)
    assert report.share == pytest.approx(0.25)
    # Its own 3 s, then this job's 1.5 s, on a quarter of two slots; all 49.5 s over both would take longer.
    assert report.eta_seconds == pytest.approx((3.0 + 1.5) / (2 * 0.25))

    lines = {line.quota: line for line in report.quota}
    assert list(lines) == ["max_input_bytes", "max_concurrent_jobs", "gpu_seconds_per_month", "max_queued_records"]
    size = path.stat().st_size
    assert (lines["max_input_bytes"].used, lines["max_input_bytes"].adds, lines["max_input_bytes"].left) == (
        0,
        size,
        10_000_000 - size,
    )
    assert (lines["max_concurrent_jobs"].used, lines["max_concurrent_jobs"].left) == (1, 0)
    assert lines["gpu_seconds_per_month"].adds == pytest.approx(3.0)
    assert lines["gpu_seconds_per_month"].left == pytest.approx(997.0)
    assert all(lines[name].refused is None for name in ("max_input_bytes", "max_concurrent_jobs"))
    queued = lines["max_queued_records"]
    assert (queued.limit, queued.used, queued.adds, queued.left) == (100, 80, 30, -10)
    assert report.accepted is False
    with pytest.raises(QuotaExceeded) as refused:
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert queued.refused == refused.value.message
    assert queued.refused == "quota max_queued_records exceeded: limit 100, in use 80, this job needs 30"


class _nothing_stored:
    """No row, no stored object and no broker message appears (or goes) inside the block."""

    def __enter__(self) -> None:
        self._before = self._snapshot()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            assert self._snapshot() == self._before

    @staticmethod
    def _snapshot() -> tuple[Any, ...]:
        rows = tuple(table.objects.count() for table in (Job, JobEvent, Shard, Quota))
        return rows, _storage_files(), _broker()


def test_a_bad_input_is_reported_line_by_line_as_a_submission_would_refuse_it(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    lines = [
        json.dumps({"custom_id": "a", "input": "a fine sentence"}),
        "this is not json",
        json.dumps({"custom_id": "a", "input": "the same id again"}),
        json.dumps({"custom_id": "c", "text": "the wrong field"}),
    ]
    path = write_jsonl(lines)
    with _nothing_stored():
        report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    with pytest.raises(SubmissionError) as refused:
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert [problem.line for problem in report.problems] == [2, 3, 4] == [p.line for p in refused.value.problems]
    assert report.rejected == refused.value.message
    assert (report.records, report.problem_count, report.accepted) == (1, 3, False)


def test_a_request_refused_before_its_input_is_read_raises_as_a_submission_does(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"input": SHORT}])
    with pytest.raises(SubmissionError) as refused:
        job_dry_run(tenant=acme, request=JobRequest(model_name="gpt-17", input_uri=str(path)))
    assert refused.value.field == "model"
    with pytest.raises(SubmissionError) as refused:
        job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=0))
    assert refused.value.field == "shard_size"


def test_a_model_without_a_tokenizer_reports_no_tokens(
    acme: Tenant, write_jsonl: Callable[..., Path], two_slots: None
) -> None:
    echo = ModelFactory(name="echo", engine=Model.Engine.PYTHON, source="tests.support.tiny_models:echo")
    report = job_dry_run(
        tenant=acme, request=JobRequest(model_name=echo.name, input_uri=str(write_jsonl([{"input": SHORT}] * 4)))
    )
    assert (report.records, report.input_tokens, report.over_length) == (4, None, None)
    assert report.accepted is True


def test_a_model_whose_weights_are_in_object_storage_is_not_downloaded_for_a_dry_run(
    acme: Tenant, write_jsonl: Callable[..., Path], two_slots: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpuworkers.sources

    def no_download(source: str) -> Path:
        raise AssertionError(f"the dry run resolved {source}")

    monkeypatch.setattr(gpuworkers.sources, "resolve_s3_source", no_download)
    remote = ModelFactory(name="remote", engine=Model.Engine.SENTENCE_TRANSFORMERS, source="s3://weights/remote/")
    report = job_dry_run(
        tenant=acme, request=JobRequest(model_name=remote.name, input_uri=str(write_jsonl([{"input": SHORT}] * 4)))
    )
    assert (report.records, report.input_tokens, report.over_length) == (4, None, None)


def test_the_dry_runs_shards_are_the_ones_the_planner_cuts(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    two_slots: None,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.BATCHERY_TARGET_SHARD_SECONDS = 1
    _learn(minilm, per_record=0.002, per_char=0.0004)
    texts = [("x" * (10 + 37 * (n % 11))) for n in range(300)]
    path = write_jsonl([{"custom_id": f"r{n}", "input": text} for n, text in enumerate(texts)])

    report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    job = job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    planned = list(Shard.objects.filter(job=job).order_by("index"))

    assert report.shards.count == len(planned) > 3
    assert [shard.records for shard in report.shards.listed] == [shard.record_count for shard in planned]
    assert [shard.seconds for shard in report.shards.listed] == pytest.approx(
        [shard.estimated_seconds for shard in planned]
    )
    assert report.queue == job_queue(job)


def _learn(model: Model, *, per_record: float, per_char: float, noise: float = 0.0) -> None:
    """Finished shards of varied record counts and lengths, each `noise` off the true cost by turns."""
    for n, (records, chars) in enumerate([(100, 5_000), (100, 50_000), (50, 20_000), (200, 10_000), (80, 60_000)]):
        real = per_record * records + per_char * chars
        throughput_observe(
            model_id=model.pk,
            gpu_class_id=model.gpu_class_id,
            records=records,
            chars=chars,
            seconds=real * (1 + noise if n % 2 else 1 - noise),
        )


def test_once_the_model_has_run_the_estimate_follows_its_observed_throughput(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path], two_slots: None
) -> None:
    per_record, per_char = 0.004, 0.0005
    texts = [("word " * (5 + n % 40)).strip() for n in range(400)]
    path = write_jsonl([{"custom_id": f"r{n}", "input": text} for n, text in enumerate(texts)])
    real = per_record * len(texts) + per_char * sum(map(len, texts))

    before: DryRunReport = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert before.observed is False
    assert before.estimated_seconds == pytest.approx(0.05 * len(texts)), "the default rate, whatever the lengths"
    assert before.over_length is not None and before.over_length.max_tokens == 256, "the model's own config"

    _learn(minilm, per_record=per_record, per_char=per_char, noise=0.1)
    after = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert after.observed is True
    assert after.estimated_seconds == pytest.approx(real, rel=0.25)
    assert after.estimated_gpu_seconds == pytest.approx(after.estimated_seconds)


def test_the_eta_shares_the_queue_while_others_have_work_and_takes_every_slot_after() -> None:
    common = {"longest_shard": 1.0, "own_backlog": 0.0, "slots": 4, "weight": 1.0, "others_weight": 1.0}
    # The others' 1000 s outlast this job's 40 s: half of four slots, all along.
    assert eta_seconds(seconds=40.0, others_backlog=1000.0, **common) == pytest.approx(40.0 / 2)
    # The others' 4 s end first; then the job has all four slots: 44 s of work over 4 slots.
    assert eta_seconds(seconds=40.0, others_backlog=4.0, **common) == pytest.approx(44.0 / 4)
    # Nobody else: the job alone on the slots, but never sooner than its longest shard.
    alone = {**common, "others_weight": 0.0, "longest_shard": 30.0}
    assert eta_seconds(seconds=40.0, others_backlog=0.0, **alone) == pytest.approx(30.0)
