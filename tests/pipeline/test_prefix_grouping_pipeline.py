"""Prefix grouping end to end, on real workers: a job whose prompts interleave six long instructions is
planned in shards of one instruction each, runs on a slot, and publishes the bytes that the same job
planned ungrouped (`prefix_reuse: false`) publishes, its error lines included."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from portal.catalog.models import Model
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tasks.shared.storage import store_for
from tests.factories import ModelFactory
from tests.support.jobs import read_lines, wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LINES = 420
VARIANTS = 6
INSTRUCTION_CHARS = 2_100
"""Longer than the characters the planner compares (BATCHERY_PREFIX_GROUP_CHARS, 2,000 by default)."""


def prompt(n: int) -> str:
    rng = random.Random(n % VARIANTS)
    instructions = f"Instructions {n % VARIANTS}: " + "".join(rng.choice("abcdefgh ") for _ in range(INSTRUCTION_CHARS))
    return f"{instructions}\nQuestion {n}{' FLAKY' if n % 11 == 0 else ''}"


def _run(acme: Any, path: Path, workers: dict[str, Any], **params: Any) -> Job:
    job = job_submit(
        tenant=acme, request=JobRequest(model_name="group-echo", input_uri=str(path), shard_size=30, params=params)
    )
    job = wait_for_job(job, workers=workers)
    assert job.status == JobStatus.PARTIALLY_SUCCEEDED, job.error
    return job


def test_an_interleaved_job_runs_grouped_and_publishes_the_bytes_of_the_same_job_ungrouped(
    pipeline_workers: dict[str, Any], acme: Any, write_jsonl: Callable[..., Path]
) -> None:
    ModelFactory(
        name="group-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.GENERATE,
        source="tests.support.chaos_engines:flaky_factory",
        is_default=False,
    )
    path = write_jsonl([{"custom_id": f"p{n}", "prompt": prompt(n)} for n in range(LINES)])

    grouped = _run(acme, path, pipeline_workers)
    plain = _run(acme, path, pipeline_workers, prefix_reuse=False)

    assert (grouped.prefix_groups, plain.prefix_groups) == (VARIANTS, 0)
    for shard in grouped.shards.all():
        with store_for(shard.input_uri).open_read(shard.input_uri) as source:
            assert len({orjson.loads(line)["prompt"][:20] for line in source}) == 1, "one instruction a shard"
    lines = read_lines(grouped.output_uri)
    assert [line["custom_id"] for line in lines] == [f"p{n}" for n in range(LINES)]
    assert sum("error" in line for line in lines) == len(range(0, LINES, 11))
    for kind in ("output_uri", "errors_uri"):
        uri_grouped, uri_plain = getattr(grouped, kind), getattr(plain, kind)
        assert store_for(uri_grouped).read_bytes(uri_grouped) == store_for(uri_plain).read_bytes(uri_plain)
