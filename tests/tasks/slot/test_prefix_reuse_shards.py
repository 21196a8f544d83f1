"""Shared system prompts computed once, through the shard body a slot runs (`execute_shard`), with a tiny
GPT-2 chat model: 2,000 chat lines, each of 20 system prompts of 1,000 tokens on every 20th line."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuworkers.spec import ModelSpec
from tasks.shared.specs import ShardManifest, ShardSpec
from tasks.slot.shard_execution import execute_shard
from tests.support.tiny_models import build_tiny_causal_lm

LINES = 2_000
VARIANTS = 20
SYSTEM_TOKENS = 1_000
"""The tiny tokenizer has one token a character."""
SHARDS = 2
"""The job's shards, run one after the other on the same slot: the second is served the first's prefixes."""
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
]


def _system_prompt(variant: int, rng: random.Random) -> str:
    text = f"You are assistant number {variant}. " + " ".join(rng.choice(WORDS) for _ in range(SYSTEM_TOKENS))
    return text[:SYSTEM_TOKENS]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    # One layer of width 16: a 1,000-token prompt must stay cheap enough to run 2,000 times without reuse.
    directory = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-chat"), n_positions=1_100, n_layer=1, n_embd=16)
    return ModelSpec(name="tiny-prefix-chat", version="1", engine="transformers", task="chat", source=str(directory))


@pytest.fixture(scope="module")
def shard_inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = random.Random(0)
    systems = [_system_prompt(variant, rng) for variant in range(VARIANTS)]
    records = [
        {
            "custom_id": f"line-{line}",
            "messages": [
                {"role": "system", "content": systems[line % VARIANTS]},
                {"role": "user", "content": f"Question {line}: {rng.choice(WORDS)}?"},
            ],
        }
        for line in range(LINES)
    ]
    directory = tmp_path_factory.mktemp("input")
    per_shard = LINES // SHARDS
    paths = []
    for index in range(SHARDS):
        path = directory / f"shard-{index:05d}.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in records[index * per_shard :][:per_shard]))
        paths.append(path)
    return paths


def _run_job(
    model: ModelSpec, inputs: list[Path], root: Path, *, prefix_reuse: bool
) -> tuple[list[ShardManifest], list[dict[str, Any]], float]:
    """The job's shards run in order; their manifests, their output lines in order, and the CPU seconds."""
    manifests = []
    started = time.process_time()
    for index, path in enumerate(inputs):
        spec = ShardSpec(
            job_id=f"prefix-{prefix_reuse}-{root.name}",
            shard_index=index,
            record_count=LINES // SHARDS,
            input_uri=path.as_uri(),
            shard_prefix=(root / "shards" / f"{index:05d}").as_uri(),
            model=model,
            input_field="messages",
            params={"max_tokens": 2, "temperature": 0, "prefix_reuse": prefix_reuse},
        )
        manifest = execute_shard(spec, worker="w1")
        assert isinstance(manifest, ShardManifest)
        manifests.append(manifest)
    cpu_seconds = time.process_time() - started
    lines = [
        orjson.loads(line)
        for manifest in manifests
        for line in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines()
    ]
    return manifests, lines, cpu_seconds


def _computed(manifests: list[ShardManifest]) -> int:
    return sum(manifest.prompt_tokens - manifest.cached_prompt_tokens for manifest in manifests)


def test_records_sharing_a_system_prompt_have_it_computed_once_with_identical_outputs_in_input_order(
    chat_model: ModelSpec, shard_inputs: list[Path], tmp_path: Path
) -> None:
    off_manifests, off_lines, off_cpu = _run_job(chat_model, shard_inputs, tmp_path / "off", prefix_reuse=False)
    on_manifests, on_lines, on_cpu = _run_job(chat_model, shard_inputs, tmp_path / "on", prefix_reuse=True)

    assert [line["custom_id"] for line in on_lines] == [f"line-{line}" for line in range(LINES)]
    assert [line["response"]["text"] for line in on_lines] == [line["response"]["text"] for line in off_lines]
    assert sum(manifest.prompt_tokens for manifest in on_manifests) == sum(m.prompt_tokens for m in off_manifests)
    assert _computed(on_manifests) * 5 <= _computed(off_manifests)
    assert on_cpu < off_cpu
    # Each record reports what it was served, and each manifest sums it.
    for manifests, lines in ((on_manifests, on_lines), (off_manifests, off_lines)):
        cached = [line["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in lines]
        per_shard = LINES // SHARDS
        assert [manifest.cached_prompt_tokens for manifest in manifests] == [
            sum(cached[index * per_shard :][:per_shard]) for index in range(SHARDS)
        ]
    assert {line["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in off_lines} == {0}
    # The second shard found every system prompt kept from the first.
    second = on_lines[LINES // SHARDS :]
    assert min(line["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in second) >= (
        SYSTEM_TOKENS - 16
    )
    print(
        f"\nprompt tokens computed: {_computed(off_manifests):,} off, {_computed(on_manifests):,} on; "
        f"CPU seconds: {off_cpu:.1f} off, {on_cpu:.1f} on"
    )
