"""Shared prompt prefixes computed once, measured: the same chat lines with prefix reuse off, then on.

A job's lines share a long system prompt in a few variants, interleaved (line i has variant i % variants),
each with a short user message of its own, as platform teams' batch files do. They go through the slot's
micro-batch loop (`run_records`) on the transformers engine with a tiny GPT-2 built on the fly, shard after
shard on one engine (so a shard finds the prefixes the one before it kept), greedy: once with
``prefix_reuse: false``, once with it on. Printed: the prompt tokens computed (prompt tokens less those a
prefix cache served), the CPU and wall seconds, and whether both runs gave the same completions.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuworkers.batching import Item, run_records
from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.settings import micro_batch_size
from gpuworkers.spec import ModelSpec
from tests.support.tiny_models import build_tiny_causal_lm

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega"]


@dataclass(frozen=True)
class PrefixRun:
    """One pass over the lines, reuse on or off."""

    prompt_tokens: int
    cached_tokens: int
    """Of the prompt tokens, those a prefix cache served."""
    cpu_s: float
    wall_s: float

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class PrefixBench:
    lines: int
    variants: int
    system_tokens: int
    shards: int
    off: PrefixRun
    on: PrefixRun
    same_outputs: bool
    """Both passes gave the same completion to every line."""


def run_prefix_bench(
    *, lines: int, variants: int = 20, system_tokens: int = 1_000, shard_size: int = 1_000, max_tokens: int = 2
) -> PrefixBench:
    """Both passes over the same ``lines`` chat lines; each system prompt is ``system_tokens`` tokens long."""
    rng = random.Random(0)
    systems = [
        (f"You are assistant number {variant}. " + " ".join(rng.choice(WORDS) for _ in range(system_tokens)))[
            :system_tokens
        ]
        for variant in range(variants)
    ]
    items = [
        Item(
            f"line-{line}",
            [
                {"role": "system", "content": systems[line % variants]},
                {"role": "user", "content": f"Question {line}: {rng.choice(WORDS)}?"},
            ],
        )
        for line in range(lines)
    ]
    shards = [items[start : start + shard_size] for start in range(0, lines, shard_size)]
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as directory:
        # The tiny tokenizer has a token a character: the context holds the system prompt, a user message
        # and the template's words around them.
        source = build_tiny_causal_lm(Path(directory) / "model", n_positions=system_tokens + 100)
        engine = TransformersEngine(
            ModelSpec(name="bench-prefix", version="1", engine="transformers", task="chat", source=str(source))
        )
        engine.load(device="cpu")
        params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0}
        off, off_texts = _run(engine, shards, {**params, "prefix_reuse": False})
        on, on_texts = _run(engine, shards, {**params, "prefix_reuse": True})
        engine.unload()
    return PrefixBench(lines, variants, system_tokens, len(shards), off, on, same_outputs=off_texts == on_texts)


def _run(engine: TransformersEngine, shards: list[list[Item]], params: dict[str, Any]) -> tuple[PrefixRun, list[str]]:
    prompt = cached = 0
    texts: list[str] = []
    cpu, wall = time.process_time(), time.perf_counter()
    for shard in shards:
        for result in run_records(engine, shard, params=params, micro_batch_size=micro_batch_size()):
            if result.response is None:
                raise RuntimeError(f"line {result.custom_id} failed: {result.error}")
            usage = result.response["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            texts.append(result.response["text"])
    return PrefixRun(prompt, cached, time.process_time() - cpu, time.perf_counter() - wall), texts


def render_prefix(bench: PrefixBench) -> str:
    def row(name: str, run: PrefixRun) -> str:
        return (
            f"  reuse {name:<4} {run.computed_tokens:>12,} prompt tokens computed of {run.prompt_tokens:,}   "
            f"CPU {run.cpu_s:6.1f} s   wall {run.wall_s:6.1f} s"
        )

    return "\n".join(
        [
            f"prefix reuse: {bench.lines:,} chat lines, {bench.variants} system prompts of {bench.system_tokens:,} "
            f"tokens interleaved, {bench.shards} shards on one tiny GPT-2 (transformers engine, CPU), greedy",
            row("off", bench.off),
            row("on", bench.on),
            f"  {bench.off.computed_tokens / max(bench.on.computed_tokens, 1):.1f}x fewer prompt tokens computed, "
            f"{bench.off.cpu_s / max(bench.on.cpu_s, 1e-9):.1f}x less CPU; same completions: "
            f"{'yes' if bench.same_outputs else 'NO'}",
            "rerun: python manage.py bench --only-prefix",
        ]
    )
