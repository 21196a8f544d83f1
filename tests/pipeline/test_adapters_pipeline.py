"""LoRA adapters end to end: one job whose lines name three adapters of one base model and the base model
itself, run by a real slot worker that keeps the base model warm and loads each adapter beside it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.spec import ModelSpec
from portal.catalog.models import Adapter, Model
from portal.jobs.models import JobAdapterUsage, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tasks.shared.specs import read_commit
from tests.factories import ModelFactory
from tests.support.jobs import read_lines, wait_for_job
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

NAMES = ["tiny-base", "alpha", "beta", "gamma"]
PARAMS = {"max_tokens": 6, "temperature": 0}


def _alone(base: Path, adapter: Path | None, prompts: list[str], target: Path) -> list[str]:
    """Each prompt's greedy answer from the base model with only this adapter merged into it (or none)."""
    source = base
    if adapter is not None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
        merged.save_pretrained(target)
        AutoTokenizer.from_pretrained(base).save_pretrained(target)
        source = target
    engine = TransformersEngine(
        ModelSpec(name=target.name, version="1", engine="transformers", task="generate", source=str(source))
    )
    engine.load(device="cpu")
    return [response["text"] for response in engine.run_batch(prompts, PARAMS)]


def test_one_job_runs_three_adapters_and_the_base_model_each_line_as_its_adapter_alone_would(
    pipeline_workers: dict[str, Any], acme: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    base = build_tiny_causal_lm(tmp_path / "tiny-base")
    model = ModelFactory(
        name="tiny-base",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.GENERATE,
        source=str(base),
        default_params=PARAMS,
        is_default=False,
    )
    adapters = {name: build_tiny_lora(base, tmp_path / name, seed=seed) for seed, name in enumerate(NAMES[1:], start=1)}
    for name, directory in adapters.items():
        Adapter.objects.create(name=name, base_model=model, owner=acme, source=str(directory), rank=4)
    records = [
        {"custom_id": f"r{n}", "model": NAMES[n % 4], "prompt": f"Prompt {n}: {'GPUs ' * (n % 3)}"} for n in range(24)
    ]
    path = write_jsonl(records)

    job = job_submit(tenant=acme, request=JobRequest(model_name="tiny-base", input_uri=str(path), shard_size=8))
    job = wait_for_job(job, workers=pipeline_workers)

    assert job.status == JobStatus.SUCCEEDED, job.error
    lines = read_lines(job.output_uri)
    assert [line["custom_id"] for line in lines] == [record["custom_id"] for record in records]
    for name in NAMES:
        mine = [n for n, record in enumerate(records) if record["model"] == name]
        expected = _alone(base, adapters.get(name), [records[n]["prompt"] for n in mine], tmp_path / f"{name}-alone")
        assert [lines[n]["response"]["text"] for n in mine] == expected, name
    # The adapters change the answers, or the comparison above would prove nothing.
    assert len({lines[n]["response"]["text"] for n in range(4)}) > 1

    manifests = [read_commit(shard.prefix_uri) for shard in job.shards.all()]
    assert len(manifests) == 3
    loads = {(manifest.worker, manifest.pid): manifest.model_loads for manifest in manifests if manifest is not None}
    assert set(loads.values()) == {1}, "the base model is loaded once a slot, whatever adapters its records name"

    usage = {row.name: row for row in JobAdapterUsage.objects.filter(usage__job=job)}
    assert sorted(usage) == ["alpha@1", "beta@1", "gamma@1", "tiny-base"]
    for name in NAMES:
        key = name if name == "tiny-base" else f"{name}@1"
        mine = [lines[n] for n, record in enumerate(records) if record["model"] == name]
        assert usage[key].records_succeeded == len(mine) == 6
        assert usage[key].completion_tokens == sum(line["response"]["usage"]["completion_tokens"] for line in mine)
        assert usage[key].prompt_tokens == sum(line["response"]["usage"]["prompt_tokens"] for line in mine)
    assert {row.adapter.name for row in usage.values() if row.adapter is not None} == {"alpha", "beta", "gamma"}
