"""A job's seed gives each record that samples a seed of its own, so the same job run again with the same
seed writes the same bytes, whatever its shard and micro-batch sizes: through the shard body a slot runs
(`execute_shard`), with a tiny GPT-2 sampling at temperature 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.batching import Item
from gpuworkers.engines.sampling import record_seed
from gpuworkers.spec import ModelSpec
from tasks.shared.specs import ShardManifest, ShardSpec
from tasks.slot.record_seeds import seeded_items
from tasks.slot.shard_execution import execute_shard
from tests.support.specs import message_spec
from tests.support.tiny_models import build_tiny_causal_lm

RECORDS = [{"custom_id": f"r{n}", "prompt": "Tell me a story" if n % 3 else f"Prompt {n}"} for n in range(30)]
"""Every third prompt differs; the others are one prompt, which only their seeds tell apart."""


def _spec(engine: str = "transformers", task: str = "generate", **params: Any) -> ShardSpec:
    return message_spec(ModelSpec(name="m", version="1", engine=engine, task=task, source="/m"), params=params)


def test_records_that_sample_get_a_seed_of_their_own_from_the_jobs_and_their_custom_id() -> None:
    items = [Item("a", "p"), Item("b", "p", {"seed": 5}), Item("c", "p", {"temperature": 0}), Item("d", "p", None)]
    params = {"seed": 42, "temperature": 0.8}

    seeded = seeded_items(_spec(**params), items, params)

    assert [item.params for item in seeded] == [
        {"seed": record_seed(42, "a")},
        {"seed": 5},  # the record's own, as it asked
        {"temperature": 0},  # greedy: left to run beside the others
        {"seed": record_seed(42, "d")},
    ]
    assert record_seed(42, "a") != record_seed(42, "d") != record_seed(43, "d")


def test_which_records_sample_follows_each_engines_default_temperature_and_only_generation_is_seeded() -> None:
    items = [Item("a", "p")]
    assert seeded_items(_spec("transformers", seed=1), items, {"seed": 1}) == items, "greedy by default"
    assert seeded_items(_spec("vllm", seed=1), items, {"seed": 1})[0].params == {"seed": record_seed(1, "a")}
    assert seeded_items(_spec("sentence_transformers", "embed"), items, {"seed": 1}) == items
    assert seeded_items(_spec(temperature=1), items, {"temperature": 1}) == items, "no seed, nothing to derive"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    directory = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-sampler"))
    return ModelSpec(name="tiny-sampler", version="1", engine="transformers", task="generate", source=str(directory))


def _run(model: ModelSpec, root: Path, *, shard_size: int, micro_batch_size: int) -> bytes:
    """The job cut every `shard_size` records, each shard run by the slot's shard body; its output, in order."""
    output = b""
    for index, start in enumerate(range(0, len(RECORDS), shard_size)):
        records = RECORDS[start : start + shard_size]
        path = root / f"input-{index}.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        spec = ShardSpec(
            job_id=f"seeded-{root.name}",
            shard_index=index,
            record_count=len(records),
            input_uri=path.as_uri(),
            shard_prefix=(root / "shards" / f"{index:05d}").as_uri(),
            model=model,
            input_field="prompt",
            params={"max_tokens": 8, "temperature": 1.0, "seed": 1234, "micro_batch_size": micro_batch_size},
        )
        manifest = execute_shard(spec, worker="w1")
        assert isinstance(manifest, ShardManifest)
        output += Path(manifest.output_uri.removeprefix("file://")).read_bytes()
    return output


def test_the_same_job_sampled_with_a_seed_writes_the_same_bytes_whatever_its_shard_and_micro_batch_sizes(
    model: ModelSpec, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _run(model, tmp_path / "a", shard_size=7, micro_batch_size=3)
    second = _run(model, tmp_path / "b", shard_size=13, micro_batch_size=16)

    assert first == second
    texts = [json.loads(line)["response"]["text"] for line in first.splitlines()]
    same_prompt = [text for record, text in zip(RECORDS, texts, strict=True) if record["prompt"] == "Tell me a story"]
    # One prompt, twenty seeds: a job's seed does not make its records draw alike.
    assert len(set(same_prompt)) > 10
