"""A job through real worker processes, the real broker and database, and the bundled model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from portal.jobs.models import JobStatus, ShardStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tests.support.jobs import read_lines, wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _sentences(count: int, prefix: str = "") -> list[str]:
    topics = ["rivers", "GPUs", "bread", "the moon", "old maps", "jazz", "glaciers", "compilers"]
    return [f"{prefix}Sentence {n} is about {topics[n % len(topics)]} and number {n * 7 % 13}." for n in range(count)]


def test_a_job_of_two_thousand_sentences_runs_in_shards_and_matches_the_model_called_directly(
    pipeline_workers: dict[str, Any], acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    sentences = _sentences(2000)
    path = write_jsonl([{"custom_id": f"s-{n}", "input": text} for n, text in enumerate(sentences)])

    job = job_submit(
        tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=250)
    )
    job = wait_for_job(job, workers=pipeline_workers)

    assert job.status == JobStatus.SUCCEEDED, job.error
    assert (job.total_records, job.succeeded_records, job.failed_records, job.shard_count) == (2000, 2000, 0, 8)
    assert set(job.shards.values_list("status", flat=True)) == {ShardStatus.SUCCEEDED}
    lines = read_lines(job.output_uri)
    assert [line["custom_id"] for line in lines] == [f"s-{n}" for n in range(2000)]
    assert read_lines(job.errors_uri) == []

    from sentence_transformers import SentenceTransformer

    from gpuworkers.sources import resolve_model_source

    direct = SentenceTransformer(str(resolve_model_source(minilm.source)), device="cpu")
    sample = list(range(0, 2000, 37))
    expected = direct.encode([sentences[n] for n in sample], convert_to_numpy=True)
    got = np.array([lines[n]["response"]["embedding"] for n in sample], dtype=np.float32)
    assert got.shape == (len(sample), 384)
    cosine = (got * expected).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() > 0.999


def test_the_model_is_loaded_once_per_worker_process_across_shards_and_jobs(
    pipeline_workers: dict[str, Any], acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    first = write_jsonl([{"input": text} for text in _sentences(300, "a ")], name="first.jsonl")
    second = write_jsonl([{"input": text} for text in _sentences(300, "b ")], name="second.jsonl")

    jobs = []
    for path in (first, second):
        job = job_submit(
            tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=50)
        )
        jobs.append(wait_for_job(job, workers=pipeline_workers))

    shards = [shard for job in jobs for shard in job.shards.order_by("index")]
    assert [job.status for job in jobs] == [JobStatus.SUCCEEDED, JobStatus.SUCCEEDED]
    assert len(shards) == 12
    assert len({shard.worker_pid for shard in shards}) == 1, "one warm worker process ran every shard"
    # The session's worker may have loaded the model for an earlier test; from here on it never loads.
    assert all(shard.cache_hit for shard in shards[1:])
    assert all(shard.load_seconds == 0 for shard in shards if shard.cache_hit)
    from tasks.shared.specs import read_commit

    # The process's count of loads of this model is the same for every shard: none loaded it again.
    # (Earlier tests on the session's worker may have loaded it before, and evicted it since.)
    loads = {read_commit(shard.prefix_uri).model_loads for shard in shards}
    assert len(loads) == 1


def test_a_record_that_makes_the_engine_raise_becomes_an_error_line_and_its_neighbours_succeed(
    pipeline_workers: dict[str, Any], acme: Any, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    records: list[dict[str, Any]] = [{"custom_id": f"r{n}", "input": f"sentence number {n}"} for n in range(120)]
    # An empty text passes the upfront check (a string) but makes the engine raise.
    records[37]["input"] = ""
    records[90]["input"] = ""
    path = write_jsonl(records)

    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=60))
    job = wait_for_job(job, workers=pipeline_workers)

    assert job.status == JobStatus.PARTIALLY_SUCCEEDED
    assert (job.succeeded_records, job.failed_records) == (118, 2)
    lines = read_lines(job.output_uri)
    assert [line["custom_id"] for line in lines] == [f"r{n}" for n in range(120)]
    assert {n for n, line in enumerate(lines) if "error" in line} == {37, 90}
    assert all(len(line["response"]["embedding"]) == 384 for line in lines if "response" in line)
    errors = read_lines(job.errors_uri)
    assert [line["custom_id"] for line in errors] == ["r37", "r90"]
    assert errors[0]["error"]["code"] == "engine_error"
    assert [(s.succeeded_records, s.failed_records) for s in job.shards.order_by("index")] == [(59, 1), (59, 1)]


def test_a_shard_task_that_fails_for_good_ends_the_job_instead_of_leaving_it_running(
    pipeline_workers: dict[str, Any], acme: Any, minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    from tests.factories import ModelFactory

    ModelFactory(name="broken-embedder", source=str(tmp_path / "no-weights-here"), is_default=False)
    path = write_jsonl([{"input": f"sentence {n}"} for n in range(30)])

    job = job_submit(tenant=acme, request=JobRequest(model_name="broken-embedder", input_uri=str(path), shard_size=10))
    job = wait_for_job(job, workers=pipeline_workers)

    assert job.status == JobStatus.FAILED
    assert job.error.startswith("3 of 3 shards failed; first: shard 0: EngineLoadError")
    assert "no-weights-here" in job.error
    assert set(job.shards.values_list("status", flat=True)) == {ShardStatus.FAILED}
    lines = read_lines(job.output_uri)
    assert len(lines) == 30
    assert all(line["error"]["code"] == "shard_failed" for line in lines)
