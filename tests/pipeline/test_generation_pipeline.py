"""Text generation through the `transformers` engine, on a tiny model saved and loaded from disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import Model
from portal.jobs.models import JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tests.factories import ModelFactory
from tests.support.jobs import read_lines, wait_for_job
from tests.support.tiny_models import build_tiny_causal_lm

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_generation_job_produces_one_completion_per_prompt_in_input_order(
    pipeline_workers: dict[str, Any], acme: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = build_tiny_causal_lm(tmp_path / "tiny-gpt2")
    ModelFactory(
        name="tiny-gpt2",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.GENERATE,
        source=str(model_dir),
        default_params={"max_tokens": 6},
        is_default=False,
    )
    prompts = [f"Prompt {n}: tell me about {'GPUs ' * (n % 4)}" for n in range(24)]
    path = write_jsonl([{"custom_id": f"p{n}", "prompt": prompt} for n, prompt in enumerate(prompts)])

    job = job_submit(tenant=acme, request=JobRequest(model_name="tiny-gpt2", input_uri=str(path), shard_size=10))
    job = wait_for_job(job, workers=pipeline_workers)

    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.shard_count == 3
    lines = read_lines(job.output_uri)
    assert [line["custom_id"] for line in lines] == [f"p{n}" for n in range(24)]
    for line in lines:
        response = line["response"]
        assert isinstance(response["text"], str)
        assert 1 <= response["usage"]["completion_tokens"] <= 6
        assert response["usage"]["prompt_tokens"] > 0
    shard_tokens = sum(job.shards.values_list("completion_tokens", flat=True))
    assert shard_tokens == sum(line["response"]["usage"]["completion_tokens"] for line in lines)
