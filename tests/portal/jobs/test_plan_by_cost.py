"""Planning by cost: with no shard size the planner cuts shards of about equal estimated seconds
from the model's learned throughput; with one it cuts by count as before. Every shard records its
input characters and estimate, on retry rounds too; a re-run keeps the original's choice."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.catalog.models import Model
from portal.catalog.throughput import throughput_observe
from portal.execution import capacity
from portal.execution.plan import job_plan
from portal.execution.shard_cut import input_chars
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.rerun import job_rerun
from portal.jobs.services.retry import job_retry
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Tenant
from tasks.shared.storage import store_for

PER_RECORD = 0.001
PER_CHAR = 0.0002  # a 500-character text costs 0.101 s, a 50-character one 0.011 s: chars dominate
SHORT, LONG = "s" * 50, "L" * 500


@pytest.fixture(autouse=True)
def _at_the_target(settings: Any) -> None:
    """These tests look at cutting at the target; the slow start of a job's first shards and the
    shrinking of its last have tests of their own."""
    settings.BATCHERY_FIRST_SHARD_SECONDS = 0
    settings.BATCHERY_GUIDED_SHARDS_PER_SLOT = 0


def _learn(model: Model) -> None:
    """Finished shards of varied length, so that the fit holds both rates."""
    for records, chars in [(100, 5_000), (100, 50_000), (50, 20_000), (200, 10_000)]:
        throughput_observe(
            model_id=model.pk,
            gpu_class_id=model.gpu_class_id,
            records=records,
            chars=chars,
            seconds=PER_RECORD * records + PER_CHAR * chars,
        )


def _planned(job: Job, capture: Any) -> list[Shard]:
    with capture():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING
    return list(job.shards.order_by("index"))


def _cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


def test_shards_cut_by_cost_take_about_equally_long_where_shards_cut_by_count_do_not(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.BATCHERY_TARGET_SHARD_SECONDS = 3
    _learn(minilm)
    # Runs of 100 short texts, then 100 ten times as long, 12 runs in all.
    texts = [SHORT if (n // 100) % 2 == 0 else LONG for n in range(1_200)]
    path = write_jsonl([{"custom_id": f"r{n}", "input": text} for n, text in enumerate(texts)])

    by_cost = _planned(
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path))),
        django_capture_on_commit_callbacks,
    )
    same_count = round(len(texts) / len(by_cost))
    by_count = _planned(
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=same_count)),
        django_capture_on_commit_callbacks,
    )

    for shards in (by_cost, by_count):
        assert sum(shard.record_count for shard in shards) == len(texts)
        assert sum(shard.input_chars for shard in shards) == sum(map(len, texts))
        for shard in shards:
            expected = PER_RECORD * shard.record_count + PER_CHAR * shard.input_chars
            assert shard.estimated_seconds == pytest.approx(expected)
    assert all(shard.record_count == same_count for shard in by_count[:-1])
    assert all(shard.estimated_seconds <= 3 for shard in by_cost)
    # The last shard of either holds whatever is left: it is left out of both figures.
    cv_cost = _cv([shard.estimated_seconds or 0.0 for shard in by_cost[:-1]])
    cv_count = _cv([shard.estimated_seconds or 0.0 for shard in by_count[:-1]])
    print(f"\n{len(by_cost)} shards each; CV of estimated seconds: by cost {cv_cost:.3f}, by count {cv_count:.3f}")
    assert cv_cost < 0.25
    assert cv_count > 0.5
    records = [shard.record_count for shard in by_cost[:-1]]
    assert max(records) > 2 * min(records)  # short texts ride in big shards, long ones in small


def test_a_model_that_never_ran_is_cut_by_its_default_seconds_a_record(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.BATCHERY_TARGET_SHARD_SECONDS = 1
    settings.BATCHERY_DEFAULT_SECONDS_PER_RECORD = 0.05
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(50)])

    shards = _planned(
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path))),
        django_capture_on_commit_callbacks,
    )

    assert [(shard.first_record, shard.record_count) for shard in shards] == [(0, 20), (20, 20), (40, 10)]
    assert [shard.estimated_seconds for shard in shards] == pytest.approx([1.0, 1.0, 0.5])


def test_a_shard_never_holds_more_than_the_record_bound_whatever_its_estimate(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.BATCHERY_MAX_SHARD_RECORDS = 4
    path = write_jsonl([{"custom_id": f"r{n}", "input": "x"} for n in range(10)])

    shards = _planned(
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path))),
        django_capture_on_commit_callbacks,
    )

    assert [shard.record_count for shard in shards] == [4, 4, 2]


def test_a_record_dearer_than_the_target_still_gets_a_shard_of_its_own(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.BATCHERY_TARGET_SHARD_SECONDS = 1
    _learn(minilm)
    huge = "h" * 20_000  # 4 s
    path = write_jsonl([{"custom_id": f"r{n}", "input": text} for n, text in enumerate([SHORT, huge, huge, SHORT])])

    shards = _planned(
        job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path))),
        django_capture_on_commit_callbacks,
    )

    assert [shard.record_count for shard in shards] == [1, 1, 1, 1]
    assert [shard.input_chars for shard in shards] == [50, 20_000, 20_000, 50]


def test_a_retry_round_of_a_job_cut_by_cost_is_cut_by_cost_too(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    settings.BATCHERY_TARGET_SHARD_SECONDS = 1
    _learn(minilm)
    texts = [LONG] * 20 + [SHORT] * 80  # 20 * 0.101 s, then 80 * 0.011 s
    path = write_jsonl([{"custom_id": f"r{n}", "input": text} for n, text in enumerate(texts)])
    job = job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    _planned(job, django_capture_on_commit_callbacks)
    with store_for(job.errors_uri).open_write(job.errors_uri) as errors:
        for n in range(100):
            errors.write(b'{"custom_id": "r%d", "error": {"code": "model_error", "message": "boom"}}\n' % n)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.FAILED, failed_records=100, finished_at=timezone.now())
    job.refresh_from_db()

    job_retry(job=job)
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))  # the retry round is cut on the planning lane

    retried = list(Shard.objects.filter(job=job, round=1).order_by("index"))
    assert sum(shard.record_count for shard in retried) == 100
    assert sum(shard.input_chars for shard in retried) == sum(map(len, texts))
    assert all(shard.estimated_seconds is not None and shard.estimated_seconds <= 1 for shard in retried)
    assert retried[0].record_count == 9  # 9 long texts fill 0.909 s of the 1 s target


def test_a_rerun_keeps_the_originals_choice_of_cutting_by_cost(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"custom_id": "a", "input": "x"}])
    acme.storage_prefixes = [path.parent.as_uri() + "/"]  # a re-run is held to the tenant's input roots
    acme.save()
    job = job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    Job.objects.filter(pk=job.pk).update(status=JobStatus.FAILED)

    assert job_rerun(job=job, actor=None).shard_size is None


def test_a_records_characters_count_its_texts_and_its_messages_contents() -> None:
    assert input_chars("hello") == 5
    assert input_chars(["ab", "cde"]) == 5
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    assert input_chars(messages) == len("be brief") + len("hi")
    assert input_chars(None) == 0
    deep: list[Any] = ["abc"]
    for _ in range(5_000):
        deep = [deep]
    assert input_chars([{"role": "user", "content": deep}]) == 3


def _hold_the_queue(tenant: Tenant, model: Model, *, slots: int) -> None:
    """Another job holds the model's queue: a shard sent to each of its `slots` slots."""
    running = Job.objects.create(
        tenant=tenant, model=model, status=JobStatus.RUNNING, input_uri="file:///x.jsonl", output_uri="file:///o.jsonl"
    )
    for index in range(slots):
        Shard.objects.create(
            job=running,
            index=index,
            first_record=index,
            record_count=1,
            input_uri=f"file:///in-{index}.jsonl",
            prefix_uri=f"file:///shard-{index}",
            status=ShardStatus.DISPATCHED,
        )


@pytest.fixture
def plan_sentences(
    acme: Tenant,
    minilm: Model,
    write_jsonl: Callable[..., Path],
    settings: Any,
    django_capture_on_commit_callbacks: Any,
) -> Callable[[], list[Shard]]:
    """Plans a job of 4,000 short sentences, nothing learned (0.05 s a record), two guided shards a
    slot; the test sets the rest of the cutting's settings before it calls."""
    settings.BATCHERY_GUIDED_SHARDS_PER_SLOT = 2
    settings.BATCHERY_DEFAULT_SECONDS_PER_RECORD = 0.05
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(4_000)])

    def plan() -> list[Shard]:
        job = job_submit(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
        return _planned(job, django_capture_on_commit_callbacks)

    return plan


def test_a_job_starts_with_short_shards_doubling_up_to_the_target_so_its_first_results_come_at_once(
    plan_sentences: Callable[[], list[Shard]], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capacity, "live_slots", lambda queue: 8)
    settings.BATCHERY_FIRST_SHARD_SECONDS = 0.5
    settings.BATCHERY_TARGET_SHARD_SECONDS = 8

    shards = plan_sentences()

    # 0.5 s, 1 s, 2 s, 4 s, then the 8 s target at 0.05 s a record (until the job nears its end).
    assert [shard.record_count for shard in shards[:6]] == [10, 20, 40, 80, 160, 160]
    assert sum(shard.record_count for shard in shards) == 4_000


def test_on_a_busy_queue_the_slow_start_is_one_short_shard_not_a_ladder_of_them(
    plan_sentences: Callable[[], list[Shard]],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    acme: Tenant,
    minilm: Model,
) -> None:
    monkeypatch.setattr(capacity, "live_slots", lambda queue: 2)
    settings.BATCHERY_FIRST_SHARD_SECONDS = 0.5
    settings.BATCHERY_TARGET_SHARD_SECONDS = 8
    settings.BATCHERY_GUIDED_SHARDS_PER_SLOT = 0
    _hold_the_queue(acme, minilm, slots=2)

    counts = [shard.record_count for shard in plan_sentences()]

    # Its shards start one at a time as others end: the first is short, for the first results; the
    # rest would only wait as long for a slot, so they are cut at the target, not 1 s, 2 s, 4 s.
    assert counts[:3] == [10, 160, 160]
    assert sum(counts) == 4_000


def test_a_job_of_known_size_ends_in_shrinking_shards_so_its_slots_end_together(
    plan_sentences: Callable[[], list[Shard]], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capacity, "live_slots", lambda queue: 2)
    settings.BATCHERY_TARGET_SHARD_SECONDS = 60
    settings.BATCHERY_MIN_SHARD_SECONDS = 1

    shards = plan_sentences()

    counts = [shard.record_count for shard in shards]
    # 200 s of work on two slots: each shard its work left over four (two a slot): 50 s, 37.5 s, ...
    assert counts[:3] == [1000, 750, 562]
    assert counts == sorted(counts, reverse=True), "shards only shrink"
    assert counts[-2] == 20, "down to the minimum second"
    assert sum(counts) == 4_000
    assert len(counts) < 40, "the shrinking costs a few shards, not hundreds"


def test_on_a_busy_queue_a_job_is_cut_at_the_target_not_spread_over_slots_it_cannot_have(
    plan_sentences: Callable[[], list[Shard]],
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    acme: Tenant,
    minilm: Model,
) -> None:
    monkeypatch.setattr(capacity, "live_slots", lambda queue: 4)
    settings.BATCHERY_TARGET_SHARD_SECONDS = 60
    settings.BATCHERY_MIN_SHARD_SECONDS = 1
    _hold_the_queue(acme, minilm, slots=4)

    counts = [shard.record_count for shard in plan_sentences()]

    # 200 s of work with no slot to spare: it gets places one at a time, so its shards are the target's
    # 60 s (on four idle slots the first would be 25 s), and its tail does not shrink: no slots to make
    # end together, only more endings (60 s, 30 s, 15 s, ... 1 s).
    assert counts == [1200, 1200, 1200, 400]


def test_a_job_too_large_to_count_at_submission_ends_in_shrinking_shards_too_from_the_bytes_left_to_read(
    plan_sentences: Callable[[], list[Shard]], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capacity, "live_slots", lambda queue: 4)  # four slack slots: a slow start of four
    settings.BATCHERY_GUIDED_SHARDS_PER_SLOT = 1
    settings.BATCHERY_TARGET_SHARD_SECONDS = 60
    settings.BATCHERY_MIN_SHARD_SECONDS = 1
    settings.BATCHERY_FIRST_SHARD_SECONDS = 4  # the first shard's 80 records tell the bytes a record
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0

    shards = plan_sentences()

    counts = [shard.record_count for shard in shards]
    assert Job.objects.get(pk=shards[0].job_id).total_records == 4_000, "counted by its planner"
    assert counts[:4] == [80, 160, 320, 640], "the slow start"
    # 2,800 records (140 s) left after those, over four (one a slot): 700 records, give or take the read-ahead.
    assert 630 <= counts[4] <= 770
    assert counts[4:] == sorted(counts[4:], reverse=True), "then shards only shrink"
    assert counts[-2] == 20, "down to the minimum second"
    assert sum(counts) == 4_000
    assert len(counts) < 40
