"""A re-run on a changed model writes a comparison report whose figures are those computed here from both
output files: generations (a tiny GPT-2 saved twice, the second's weights perturbed), embeddings (the
bundled model and a perturbed copy) and classification (a tiny classifier and a perturbed copy). Jobs run in
this process (`tests.support.reruns`); real PostgreSQL and files."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from celery.exceptions import SoftTimeLimitExceeded

from portal.catalog.models import Model
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services import comparison
from portal.jobs.services.comparison import (
    ComparisonNotReady,
    ComparisonPending,
    NotARerun,
    OutputsNotComparable,
    job_comparison,
    job_comparison_read,
    job_comparison_write,
)
from portal.jobs.services.rerun import RerunChanges, job_rerun, rerun_params
from portal.jobs.services.submit import job_submit
from portal.jobs.storage_layout import comparison_uri, job_root
from tasks import send
from tasks.shared.leases import Lease, job_lease_key, lease_holder
from tasks.shared.redis_client import redis_client
from tasks.shared.storage import store_for
from tests.factories import ModelFactory, TenantFactory
from tests.support.reruns import edit_distance, run_in_process
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_classifier, save_perturbed_copy

pytestmark = pytest.mark.django_db

WORDS = ["apple", "river", "stone", "cloud", "lamp", "tiger", "music", "glass", "paper", "orbit"]


def lines(uri: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in store_for(uri).read_bytes(uri).splitlines()]


@pytest.fixture
def roots(settings: Any, tmp_path: Path) -> Path:
    """Inputs under `tmp_path` may be read by a re-run, which holds the input to the tenant's roots."""
    settings.BATCHERY_INPUT_ROOTS = [tmp_path.as_uri()]
    return tmp_path


def submitted(
    tmp_path: Path, model: str, records: list[dict[str, Any]], version: str | None = None, **params: Any
) -> Job:
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return job_submit(
        tenant=TenantFactory(),
        request=JobRequest(
            model_name=model, model_version=version, input_uri=str(path), shard_size=16, params=params or None
        ),
    )


def rerun_and_compare(job: Job, changes: RerunChanges, captured: Any) -> tuple[Job, Job, dict[str, Any]]:
    old = run_in_process(job, captured)
    assert old.status == JobStatus.SUCCEEDED, old.error
    new = job_rerun(job=old, actor=None, changes=changes)
    assert new.rerun_of == old
    with pytest.raises(ComparisonNotReady):
        job_comparison(job=new)
    merged: list[Any] = []
    new = run_in_process(new, captured, merged=merged)
    assert new.status == JobStatus.SUCCEEDED, new.error
    # The merge that ended the re-run sends the comparison task; what that task runs writes the report.
    sent: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(send, "send_comparison", sent.append)
        for callback in merged:
            callback()
    assert sent == [str(new.id)]
    job_comparison_write(job_id=sent[0], worker="compare@test")
    uri = comparison_uri(job_root(new))
    assert store_for(uri).exists(uri), "written by the task, before anyone asked"
    report = job_comparison(job=new)
    return old, new, report


def test_a_rerun_on_perturbed_weights_reports_the_generations_figures_computed_from_both_outputs(
    roots: Path, django_capture_on_commit_callbacks: Any
) -> None:
    tiny = build_tiny_causal_lm(roots / "tiny")
    for version, source in (("1", tiny), ("2", save_perturbed_copy(tiny, roots / "tiny-2", scale=0.3))):
        ModelFactory(
            name="tiny-gen",
            version=version,
            engine=Model.Engine.TRANSFORMERS,
            task=Model.Task.GENERATE,
            source=str(source),
            is_default=False,
            default_params={},
        )
    records = [{"prompt": f"{WORDS[n % 10]} {n}: "} for n in range(40)]
    job = submitted(roots, "tiny-gen", records, version="1", max_tokens=12, temperature=0)

    old, new, report = rerun_and_compare(
        job, RerunChanges(model_version="2", params={"max_tokens": 16}), django_capture_on_commit_callbacks
    )

    assert (new.model.version, new.params["max_tokens"], new.params["temperature"]) == ("2", 16, 0), "params merged"
    olds = [line["response"] for line in lines(old.output_uri)]
    news = [line["response"] for line in lines(new.output_uri)]
    distances = [
        edit_distance(a["text"], b["text"]) / max(len(a["text"]), len(b["text"]))
        if max(len(a["text"]), len(b["text"]))
        else 0.0
        for a, b in zip(olds, news, strict=True)
    ]
    exact = sum(a["text"] == b["text"] for a, b in zip(olds, news, strict=True)) / len(olds)
    assert exact < 1, "the perturbed weights change some generations"
    text = report["text"]
    assert report["records"] == {"compared": 40, "both_ok": 40, "ok_to_error": 0, "error_to_ok": 0, "both_error": 0}
    assert text["exact_match_rate"] == exact
    assert text["edit_distance"]["mean"] == pytest.approx(np.mean(distances))
    assert text["edit_distance"]["median"] == pytest.approx(np.median(distances))
    assert (
        text["edit_distance"]["histogram"]["counts"] == np.histogram(distances, bins=np.linspace(0, 1, 11))[0].tolist()
    )
    finish = Counter(
        f"{a['finish_reason']}->{b['finish_reason']}"
        for a, b in zip(olds, news, strict=True)
        if a["finish_reason"] != b["finish_reason"]
    )
    assert text["finish_reason_changes"] == dict(finish)
    chars = np.mean([len(b["text"]) - len(a["text"]) for a, b in zip(olds, news, strict=True)])
    tokens = np.mean(
        [b["usage"]["completion_tokens"] - a["usage"]["completion_tokens"] for a, b in zip(olds, news, strict=True)]
    )
    assert text["mean_length_change"] == {"chars": pytest.approx(chars), "completion_tokens": pytest.approx(tokens)}
    most = max(range(40), key=lambda n: (distances[n], -n))
    assert text["most_changed"][0]["custom_id"] == str(most + 1)
    assert (report["old"]["model_version"], report["new"]["model_version"]) == ("1", "2")

    uri = comparison_uri(job_root(new))
    assert orjson.loads(store_for(uri).read_bytes(uri)) == report, "written beside the output"
    assert job_comparison(job=new) == report, "read back, not computed again"


def test_a_rerun_of_the_bundled_embedding_model_on_perturbed_weights_reports_cosines_and_neighbours(
    roots: Path, minilm: Model, django_capture_on_commit_callbacks: Any
) -> None:
    from gpuworkers.sources import resolve_model_source

    bundled = Path(resolve_model_source(minilm.source))
    ModelFactory(
        name="minilm-perturbed",
        engine=Model.Engine.SENTENCE_TRANSFORMERS,
        task=Model.Task.EMBED,
        source=str(save_perturbed_copy(bundled, roots / "minilm-perturbed", scale=0.02)),
        is_default=False,
    )
    records = [{"input": f"The {WORDS[n % 10]} and the {WORDS[(n * 7) % 10]} number {n}"} for n in range(36)]
    job = submitted(roots, minilm.name, records)

    old, new, report = rerun_and_compare(
        job, RerunChanges(model_name="minilm-perturbed"), django_capture_on_commit_callbacks
    )

    def unit(uri: str) -> np.ndarray:
        vectors = np.asarray([line["response"]["embedding"] for line in lines(uri)], dtype=np.float64)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    a, b = unit(old.output_uri), unit(new.output_uri)
    cosines = np.clip((a * b).sum(axis=1), -1, 1)
    figures = report["embeddings"]
    assert figures["cosine"]["mean"] == pytest.approx(cosines.mean())
    assert figures["cosine"]["p5"] == pytest.approx(np.percentile(cosines, 5))
    assert figures["cosine"]["min"] == pytest.approx(cosines.min())
    edges = figures["cosine"]["histogram"]["edges"]
    assert figures["cosine"]["histogram"]["counts"] == np.histogram(cosines, bins=edges)[0].tolist()
    assert cosines.min() < 0.9999, "the perturbation moved the vectors"
    lowest = [str(n + 1) for n in np.argsort(cosines)[:20]]
    assert [entry["custom_id"] for entry in figures["least_similar"]] == lowest

    def neighbours(vectors: np.ndarray, row: int) -> set[int]:
        similarity = vectors @ vectors[row]
        similarity[row] = -np.inf
        return set(np.argsort(-similarity)[:10].tolist())

    overlaps = [len(neighbours(a, row) & neighbours(b, row)) / 10 for row in range(36)]
    assert figures["neighbours"]["k"] == 10
    assert (figures["neighbours"]["pool"], figures["neighbours"]["sample"]) == (36, 36), "36 records: all queried"
    assert figures["neighbours"]["mean_overlap"] == pytest.approx(np.mean(overlaps), abs=1e-6)


def test_a_rerun_of_a_classifier_reports_the_confusion_between_old_and_new_labels(
    roots: Path, django_capture_on_commit_callbacks: Any
) -> None:
    labels = ["calm", "angry", "sad"]
    tiny = build_tiny_classifier(roots / "clf", labels)
    for name, source in (("clf", tiny), ("clf-b", save_perturbed_copy(tiny, roots / "clf-b", scale=0.5))):
        ModelFactory(
            name=name,
            engine=Model.Engine.TRANSFORMERS,
            task=Model.Task.CLASSIFY,
            source=str(source),
            is_default=False,
            default_params={},
        )
    records = [{"input": f"{WORDS[n % 10]} {WORDS[(n * 3) % 10]} {n}"} for n in range(30)]
    job = submitted(roots, "clf", records)

    old, new, report = rerun_and_compare(job, RerunChanges(model_name="clf-b"), django_capture_on_commit_callbacks)

    pairs = Counter(
        (a["response"]["label"], b["response"]["label"])
        for a, b in zip(lines(old.output_uri), lines(new.output_uri), strict=True)
    )
    figures = report["classification"]
    seen = sorted({label for pair in pairs for label in pair})
    assert figures["labels"] == seen
    assert figures["confusion"] == {o: {n: pairs[(o, n)] for n in seen} for o in seen}
    assert figures["agreement_rate"] == sum(count for (o, n), count in pairs.items() if o == n) / 30


def classifier_rerun(roots: Path, captured: Any) -> Job:
    """A 30-record classifier job and its re-run on a perturbed copy, both succeeded; the re-run's merge's
    comparison task is not run."""
    tiny = build_tiny_classifier(roots / "clf", ["calm", "angry"])
    for name, source in (("clf", tiny), ("clf-b", save_perturbed_copy(tiny, roots / "clf-b", scale=0.5))):
        ModelFactory(name=name, engine=Model.Engine.TRANSFORMERS, task=Model.Task.CLASSIFY, source=str(source),
                     is_default=False, default_params={})  # fmt: skip
    old = run_in_process(submitted(roots, "clf", [{"input": f"{word} {n}"} for n, word in enumerate(WORDS * 3)]),
                         captured)  # fmt: skip
    new = run_in_process(job_rerun(job=old, actor=None, changes=RerunChanges(model_name="clf-b")), captured)
    assert (old.status, new.status, new.total_records) == (JobStatus.SUCCEEDED, JobStatus.SUCCEEDED, 30)
    redis_client().delete(f"batchery:compare-asked:{new.id}")
    return new


def test_a_large_reruns_comparison_is_written_by_the_task_which_a_read_asks_once_not_within_the_read(
    roots: Path, settings: Any, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = classifier_rerun(roots, django_capture_on_commit_callbacks)
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 29
    sent: list[str] = []
    monkeypatch.setattr(send, "send_comparison", sent.append)
    uri = comparison_uri(job_root(new))

    for _ in range(3):
        with pytest.raises(ComparisonPending, match="30 records"):
            job_comparison_read(job=new)
    assert sent == [str(new.id)], "asked once, not at every read"
    assert not store_for(uri).exists(uri), "not computed within a read"

    # While a task writes it, a read asks for no other, and a second task leaves it to the first.
    redis_client().delete(f"batchery:compare-asked:{new.id}")
    with Lease(job_lease_key("compare", str(new.id)), "compare-1@test", exclusive=True):
        with pytest.raises(ComparisonPending):
            job_comparison_read(job=new)
        job_comparison_write(job_id=str(new.id), worker="compare-2@test")
        assert not store_for(uri).exists(uri)
    assert sent == [str(new.id)]

    job_comparison_write(job_id=sent[0], worker="compare-1@test")
    report = job_comparison_read(job=new)
    assert report["records"]["compared"] == 30
    assert job_comparison(job=new) == report


def test_a_large_rerun_whose_outputs_the_task_cannot_compare_is_answered_why_not_pending_for_ever(
    roots: Path, settings: Any, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = classifier_rerun(roots, django_capture_on_commit_callbacks)
    assert new.rerun_of is not None
    old_output = new.rerun_of.output_uri
    kept = store_for(old_output).read_bytes(old_output).splitlines(keepends=True)[:-1]
    with store_for(old_output).open_write(old_output) as target:
        target.write(b"".join(kept))  # one line short: the outputs are no longer of one input
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 29
    sent: list[str] = []
    monkeypatch.setattr(send, "send_comparison", sent.append)
    with pytest.raises(ComparisonPending):
        job_comparison_read(job=new)

    job_comparison_write(job_id=sent[0], worker="compare@test")

    with pytest.raises(OutputsNotComparable, match="not of one input"):
        job_comparison_read(job=new)
    assert sent == [str(new.id)], "the task is not asked again while its answer is kept"


def test_a_read_leaves_a_small_comparison_to_the_reader_already_computing_it(
    roots: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    new = classifier_rerun(roots, django_capture_on_commit_callbacks)
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 5_000
    uri = comparison_uri(job_root(new))

    # Parallel reads of a report not written each computed it: the second waits for the first's file.
    with Lease(job_lease_key("compare", str(new.id)), "read@another-portal-worker", exclusive=True):
        with pytest.raises(ComparisonPending, match="being written"):
            job_comparison_read(job=new)
        assert not store_for(uri).exists(uri), "not computed while another reader computes it"

    report = job_comparison_read(job=new)
    assert report["records"]["compared"] == 30
    assert store_for(uri).exists(uri)


def test_a_comparison_task_past_its_time_limit_is_answered_why_and_not_sent_again_at_every_poll(
    roots: Path, settings: Any, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = classifier_rerun(roots, django_capture_on_commit_callbacks)
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 29
    sent: list[str] = []
    monkeypatch.setattr(send, "send_comparison", sent.append)
    with pytest.raises(ComparisonPending):
        job_comparison_read(job=new)

    def out_of_time(**kwargs: Any) -> dict[str, Any]:
        raise SoftTimeLimitExceeded()  # what Celery raises in the task's thread at its soft time limit

    with monkeypatch.context() as patch:
        patch.setattr(comparison, "compare_outputs", out_of_time)
        job_comparison_write(job_id=sent[0], worker="compare@test")

    redis_client().delete(f"batchery:compare-asked:{new.id}")  # past ASKED_AGAIN_AFTER_S
    for _ in range(3):
        with pytest.raises(OutputsNotComparable, match="longer than the comparison task may run"):
            job_comparison_read(job=new)
    assert sent == [str(new.id)], "the task is not sent again at every poll while its answer is kept"
    assert lease_holder(job_lease_key("compare", str(new.id))) is None


def test_a_comparison_task_killed_again_and_again_is_answered_why_and_not_started_for_ever(
    roots: Path, settings: Any, django_capture_on_commit_callbacks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = classifier_rerun(roots, django_capture_on_commit_callbacks)
    assert new.rerun_of is not None
    settings.BATCHERY_COMPARISON_INLINE_RECORDS = 29
    sent: list[str] = []
    monkeypatch.setattr(send, "send_comparison", sent.append)
    # Three starts that never ended: each killed (its hard time limit, its memory) and its message given back.
    redis_client().set(f"batchery:compare-started:{new.id}:{new.rerun_of.retry_round}:{new.retry_round}", 3)

    job_comparison_write(job_id=str(new.id), worker="compare@test")

    uri = comparison_uri(job_root(new))
    assert not store_for(uri).exists(uri), "the fourth start does not try again"
    for _ in range(3):
        with pytest.raises(OutputsNotComparable, match="stopped 3 times before it finished"):
            job_comparison_read(job=new)
    assert sent == [], "nor do the reads ask for it while the answer is kept"


def test_a_rerun_of_another_task_is_refused_naming_the_model_and_a_job_that_is_no_rerun_has_no_comparison(
    roots: Path, minilm: Model, tmp_path: Path
) -> None:
    ModelFactory(
        name="tiny-gen",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.GENERATE,
        source=str(build_tiny_causal_lm(tmp_path / "tiny")),
        is_default=False,
        default_params={},
    )
    job = submitted(roots, minilm.name, [{"input": "a"}, {"input": "b"}])
    with pytest.raises(SubmissionError) as refused:
        job_rerun(job=job, actor=None, changes=RerunChanges(model_name="tiny-gen"))
    assert refused.value.field == "model"
    assert Job.objects.count() == 1, "the refused re-run left no job"
    with pytest.raises(NotARerun):
        job_comparison(job=job)


def test_params_are_merged_over_the_old_ones_and_a_null_removes_a_key() -> None:
    old = {"max_tokens": 8, "temperature": 0.7, "seed": 3}
    assert rerun_params(old, {"max_tokens": 16, "seed": None, "top_p": 0.9}) == {
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    assert rerun_params(old, None) == old


def test_the_command_line_reruns_a_job_with_changes_and_names_a_refused_field(roots: Path, minilm: Model) -> None:
    from io import StringIO

    from django.core.management import CommandError, call_command

    job = submitted(roots, minilm.name, [{"input": "a"}, {"input": "b"}], batch_size=8)
    out = StringIO()
    call_command("rerun", str(job.pk), "--params", '{"batch_size": 4, "normalize": true}', stdout=out)
    rerun = Job.objects.get(rerun_of=job)
    assert f"job {rerun.id} re-runs job {job.pk}" in out.getvalue()
    assert rerun.params == {**job.params, "batch_size": 4, "normalize": True}
    with pytest.raises(CommandError, match="must be a JSON object"):
        call_command("rerun", str(job.pk), "--params", "[1]")
    with pytest.raises(CommandError, match=r"^model: "):
        call_command("rerun", str(job.pk), "--model", "no-such-model")
