"""The planner keeps records whose prompts begin alike in the same shards: 2,000 chat lines, each of 20
system prompts on every 20th line, are planned in shards of one system prompt each, every shard's
records in input order with their positions beside, every line in exactly one shard; and a planner
that dies anywhere in planning a grouped job leaves a plan its replacement makes whole."""

from __future__ import annotations

import json
import random
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from portal.catalog.models import Model
from portal.execution import plan, plan_grouped
from portal.execution.merge_order import shard_positions
from portal.execution.plan import job_plan
from portal.jobs.management.commands.submit import report_lines
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.dry_run import PrefixGroups, job_dry_run
from portal.jobs.services.submit import job_submit
from tasks.shared.storage import store_for
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db

LINES = 2_000
VARIANTS = 20
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def system_prompt(variant: int) -> str:
    rng = random.Random(variant)
    return (f"You are assistant number {variant}. " + " ".join(rng.choice(WORDS) for _ in range(200)))[:1_000]


def chat_lines(path: Path, lines: int = LINES) -> Path:
    """Line i asks question i under system prompt i % VARIANTS."""
    with path.open("w") as handle:
        for n in range(lines):
            messages = [
                {"role": "system", "content": system_prompt(n % VARIANTS)},
                {"role": "user", "content": f"Question {n}: what is {n} squared?"},
            ]
            handle.write(json.dumps({"custom_id": f"r{n}", "messages": messages}) + "\n")
    return path


@pytest.fixture
def chat_model(db: None) -> Model:
    return ModelFactory(
        name="group-chat", engine=Model.Engine.TRANSFORMERS, task=Model.Task.CHAT, source="/x", is_default=False
    )


def planned(path: Path, captured: Any, **request: Any) -> Job:
    job = job_submit(
        tenant=TenantFactory(name="acme"), request=JobRequest(model_name="group-chat", input_uri=str(path), **request)
    )
    with captured():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    return job


def shard_contents(job: Job) -> list[tuple[list[int], set[str], list[int]]]:
    """Each first-round shard's (record numbers from its custom ids, system prompts, positions file)."""
    contents = []
    for shard in job.shards.filter(round=0).order_by("index"):
        with store_for(shard.input_uri).open_read(shard.input_uri) as source:
            records = [orjson.loads(line) for line in source]
        numbers = [int(record["custom_id"][1:]) for record in records]
        systems = {record["messages"][0]["content"] for record in records}
        assert shard.record_count == len(records)
        assert shard.first_record == numbers[0]
        positions = list(shard_positions(shard)) if job.prefix_groups else []
        contents.append((numbers, systems, positions))
    return contents


def assert_grouped_plan(job: Job) -> None:
    assert job.status == JobStatus.RUNNING, job.error
    assert job.prefix_groups == VARIANTS
    assert job.total_records == LINES
    contents = shard_contents(job)
    assert job.shard_count == len(contents)
    covered: list[int] = []
    for numbers, systems, positions in contents:
        assert len(systems) == 1, "a shard holds the records of one system prompt"
        assert numbers == sorted(numbers), "a shard's records are in input order"
        assert positions == numbers, "the positions beside a shard are its records' lines"
        covered += numbers
    assert sorted(covered) == list(range(LINES)), "every line is in exactly one shard"


def test_interleaved_system_prompts_are_planned_in_shards_of_one_prompt_each(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    job = planned(chat_lines(tmp_path / "chat.jsonl"), django_capture_on_commit_callbacks, shard_size=40)

    assert_grouped_plan(job)
    assert job.shard_count == VARIANTS * 3, "each prompt's 100 records in shards of 40, 40 and 20"


def test_a_job_cut_by_cost_is_grouped_too(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    job = planned(chat_lines(tmp_path / "chat.jsonl"), django_capture_on_commit_callbacks)

    assert_grouped_plan(job)


def test_with_grouping_off_or_prefix_reuse_off_every_shard_holds_every_prompt(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    path = chat_lines(tmp_path / "chat.jsonl")
    no_reuse = planned(path, django_capture_on_commit_callbacks, shard_size=100, params={"prefix_reuse": False})
    settings.BATCHERY_PREFIX_GROUPING = False
    off = planned(path, django_capture_on_commit_callbacks, shard_size=100)

    for job in (no_reuse, off):
        assert job.prefix_groups == 0
        contents = shard_contents(job)
        assert [numbers for numbers, _, _ in contents] == [list(range(n, n + 100)) for n in range(0, LINES, 100)]
        assert all(len(systems) == VARIANTS for _, systems, _ in contents)


def test_the_dry_run_names_the_groups_and_cuts_the_shards_the_planner_cuts(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    path = chat_lines(tmp_path / "chat.jsonl")
    request = JobRequest(model_name="group-chat", input_uri=str(path), shard_size=30)
    report = job_dry_run(tenant=TenantFactory(name="acme"), request=request)
    job = planned(path, django_capture_on_commit_callbacks, shard_size=30)

    assert_grouped_plan(job)
    assert report.prefix_groups == PrefixGroups(groups=VARIANTS, records=LINES)
    assert "grouped    2,000 records in 20 groups whose prompts begin alike" in "\n".join(report_lines(report))
    assert report.shards.count == job.shard_count == VARIANTS * 4, "each prompt's 100 records in 30, 30, 30 and 10"
    shards = job.shards.order_by("index")
    assert [shard.records for shard in report.shards.listed] == [shard.record_count for shard in shards]
    assert [shard.seconds for shard in report.shards.listed] == pytest.approx(
        [shard.estimated_seconds for shard in shards]
    )

    ungrouped = job_dry_run(tenant=job.tenant, request=replace(request, params={"prefix_reuse": False}))
    assert ungrouped.prefix_groups is None
    assert ungrouped.shards.count == 67, "2,000 records in shards of 30, in input order"


def test_prompts_that_share_no_beginning_are_planned_as_before(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    path = tmp_path / "plain.jsonl"
    path.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q {n}"}]}) + "\n" for n in range(300))
    )
    job = planned(path, django_capture_on_commit_callbacks, shard_size=100)

    assert job.prefix_groups == 0
    assert list(job.shards.order_by("index").values_list("first_record", flat=True)) == [0, 100, 200]


class PlannerDied(BaseException):
    """Stands for the planner's process dying: nothing in the planner catches it."""


def test_a_planner_that_dies_before_creating_the_rows_leaves_none_and_its_replacement_plans_whole(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[int] = []

    def die_after_some_shards(planned_shard: Any) -> None:
        written.append(planned_shard.index)
        if len(written) == 25:
            raise PlannerDied

    monkeypatch.setattr(plan, "shard_within_limit", die_after_some_shards)
    path = chat_lines(tmp_path / "chat.jsonl")
    job = job_submit(
        tenant=TenantFactory(name="acme"),
        request=JobRequest(model_name="group-chat", input_uri=str(path), shard_size=40),
    )
    with django_capture_on_commit_callbacks(), pytest.raises(PlannerDied):
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert (job.status, job.shards.count(), job.prefix_groups) == (JobStatus.PLANNING, 0, 0)

    monkeypatch.undo()
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))  # as the reconciler replans a stalled planning job
    job.refresh_from_db()

    assert_grouped_plan(job)


def planned_until_running(tmp_path: Path, captured: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Job]:
    """A grouped job whose planner created its rows and died before moving the job to running."""
    transition = plan.job_transition

    def die_before_running(**kwargs: Any) -> bool:
        if kwargs["target"] == JobStatus.RUNNING:
            raise PlannerDied
        return transition(**kwargs)

    monkeypatch.setattr(plan, "job_transition", die_before_running)
    path = chat_lines(tmp_path / "chat.jsonl")
    job = job_submit(
        tenant=TenantFactory(name="acme"),
        request=JobRequest(model_name="group-chat", input_uri=str(path), shard_size=40),
    )
    with captured(), pytest.raises(PlannerDied):
        job_plan(job_id=str(job.id))
    return path, job


def test_a_planner_that_dies_after_creating_the_rows_leaves_a_plan_its_replacement_keeps(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, job = planned_until_running(tmp_path, django_capture_on_commit_callbacks, monkeypatch)
    job.refresh_from_db()
    assert job.status == JobStatus.PLANNING
    rows = list(job.shards.order_by("index").values_list("index", "input_uri", "first_record", "record_count"))
    assert len(rows) == VARIANTS * 3
    inputs = {uri: Path(uri.removeprefix("file://")).read_bytes() for _, uri, _, _ in rows}

    monkeypatch.undo()
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()

    assert_grouped_plan(job)
    assert list(job.shards.order_by("index").values_list("index", "input_uri", "first_record", "record_count")) == rows
    assert {uri: Path(uri.removeprefix("file://")).read_bytes() for uri in inputs} == inputs, "no input rewritten"


def test_rows_are_not_created_beside_another_planners(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.BATCHERY_PREFIX_GROUP_MIN_RECORDS = 5
    job = planned(chat_lines(tmp_path / "chat.jsonl", lines=200), django_capture_on_commit_callbacks, shard_size=40)
    before = list(job.shards.values_list("pk", flat=True))
    Job.objects.filter(pk=job.pk).update(status=JobStatus.PLANNING)

    assert not plan_grouped.grouped_shards_create(job=job, shards=[], groups=VARIANTS)
    assert list(job.shards.values_list("pk", flat=True)) == before


def test_the_positions_file_holds_little_endian_64_bit_positions(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.BATCHERY_PREFIX_GROUP_MIN_RECORDS = 5
    job = planned(chat_lines(tmp_path / "chat.jsonl", lines=200), django_capture_on_commit_callbacks, shard_size=40)
    shard = job.shards.order_by("index").first()
    assert shard is not None
    raw = Path(shard.input_uri.removeprefix("file://").removesuffix(".jsonl") + ".positions").read_bytes()
    assert list(array("Q", raw)) == list(range(0, 200, VARIANTS))  # on this little-endian machine
    assert raw[:8] == (0).to_bytes(8, "little") and raw[8:16] == (VARIANTS).to_bytes(8, "little")


def test_a_replanned_grouped_job_whose_input_changed_fails_instead_of_mixing_plans(
    chat_model: Model, tmp_path: Path, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, job = planned_until_running(tmp_path, django_capture_on_commit_callbacks, monkeypatch)
    monkeypatch.undo()
    shards = job.shards.count()
    with path.open("a") as handle:
        handle.write(json.dumps({"messages": [{"role": "user", "content": "one more"}]}) + "\n")

    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()

    assert job.status == JobStatus.FAILED
    assert "the input changed while it was planned" in job.error
    assert job.shards.count() == shards, "no shard added to the grouped plan"
