"""LoRA adapters on one warm base model, measured: records/s of the base model alone, then with 1, 4 and 16 adapters.

The same prompts go through the slot's micro-batch loop (`run_records`) on the transformers engine (CPU, greedy,
the same ``max_tokens``), each record's adapter set under `ADAPTER_PARAM` as the slot sets it
(`tasks.slot.record_adapters`), spread round-robin (record i on adapter i % n) as a mixed job's lines are. The
model is a small GPT-2 built on the fly, wider and deeper than the tests' so that a record's compute is not all
overhead. One engine runs every configuration, one after another, after a warm-up run of the base model; each
configuration has adapters of its own, so that its run includes their loads on first use, and the same loads
are timed apart on a fresh copy of the base model.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.environment import environment
from bench.prefix import WORDS
from gpuworkers.batching import Item, run_records
from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.lora import LoraAdapters
from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.settings import MAX_LORAS, TORCH_THREADS, micro_batch_size
from gpuworkers.spec import AdapterSpec, ModelSpec
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora

ADAPTER_COUNTS = (1, 4, 16)
"""The configurations after the base model alone: adapters the records are spread over."""

RANK = 4
"""The adapters' LoRA rank."""

TORCH_THREADS_USED = 1
"""Torch threads of the engine: what each slot of a CPU host gets by default (a slot a core, `gpuworkers.slots`).
One thread also keeps the figures steady on a shared machine, where two threads stall on a busy neighbour."""


@dataclass(frozen=True)
class LoraRun:
    """One pass over the records with one configuration."""

    adapters: int
    """Adapters the records were spread over; 0 is the base model alone."""
    outputs: int
    """Responses the run gave (every record's, or the run raised)."""
    completion_tokens: int
    wall_s: float
    """Seconds the run took, its adapters' first loads included."""
    cpu_s: float
    load_s: float
    """Seconds loading this configuration's adapters takes, timed apart on a fresh copy of the base model."""

    @property
    def records_per_s(self) -> float:
        return self.outputs / self.wall_s


@dataclass(frozen=True)
class LoraBench:
    records: int
    max_tokens: int
    layers: int
    width: int
    weights_bytes: int
    """The base model's weights in memory."""
    torch_threads: int
    micro_batch_size: int
    runs: list[LoraRun]
    """The base model alone first, then one run per adapter count."""

    @property
    def base(self) -> LoraRun:
        return self.runs[0]


def run_lora_bench(
    *,
    records: int,
    adapter_counts: tuple[int, ...] = ADAPTER_COUNTS,
    max_tokens: int = 16,
    layers: int = 4,
    width: int = 128,
) -> LoraBench:
    """The base model alone, then each of ``adapter_counts``, over the same ``records`` prompts.

    `BATCHERY_MAX_LORAS` is set, for the run only, to every adapter built, so that none is dropped and each
    configuration's run loads exactly its own adapters; `BATCHERY_TORCH_THREADS` to `TORCH_THREADS_USED`.
    Raises `RuntimeError` when a record fails.
    """
    # Imported here, as the engines do: the other parts of `manage.py bench` do not need torch.
    import torch

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(records)]
    params = {"max_tokens": max_tokens, "temperature": 0}
    threads_before = torch.get_num_threads()
    with (
        tempfile.TemporaryDirectory(prefix="bench-lora-") as directory,
        environment({MAX_LORAS.name: str(sum(adapter_counts)), TORCH_THREADS.name: str(TORCH_THREADS_USED)}),
    ):
        # A token a character: the longest prompt (10 words of up to 7 letters) and its completion fit.
        source = build_tiny_causal_lm(
            Path(directory) / "model", n_positions=max_tokens + 96, n_layer=layers, n_embd=width
        )
        adapter_sets = _adapter_sets(source, Path(directory), adapter_counts)
        engine = TransformersEngine(
            ModelSpec(name="bench-lora", version="1", engine="transformers", task="generate", source=str(source))
        )
        try:
            engine.load(device="cpu")  # sets torch's threads from BATCHERY_TORCH_THREADS, for the whole process
            weights_bytes = engine.memory_bytes()
            _run(engine, [Item(f"warm-{n}", prompt) for n, prompt in enumerate(prompts[: micro_batch_size()])], params)
            runs = [_timed(engine, prompts, params, adapters=[], source=source)]
            runs += [_timed(engine, prompts, params, adapters=adapters, source=source) for adapters in adapter_sets]
            threads = torch.get_num_threads()
        finally:
            engine.unload()
            torch.set_num_threads(threads_before)
    return LoraBench(records, max_tokens, layers, width, weights_bytes, threads, micro_batch_size(), runs)


def _adapter_sets(source: Path, directory: Path, counts: tuple[int, ...]) -> list[list[dict[str, Any]]]:
    """Adapters of their own for each count, as the `AdapterSpec` dicts the slot puts under `ADAPTER_PARAM`."""
    sets: list[list[dict[str, Any]]] = []
    seed = 0
    for count in counts:
        adapters = []
        for _ in range(count):
            path = build_tiny_lora(source, directory / f"adapter-{seed}", seed=seed, rank=RANK)
            adapters.append(AdapterSpec(name=f"adapter-{seed}", version="1", source=str(path), rank=RANK).to_dict())
            seed += 1
        sets.append(adapters)
    return sets


def _timed(
    engine: TransformersEngine,
    prompts: list[str],
    params: dict[str, Any],
    *,
    adapters: list[dict[str, Any]],
    source: Path,
) -> LoraRun:
    items = [
        Item(f"record-{n}", prompt, {ADAPTER_PARAM: adapters[n % len(adapters)]} if adapters else None)
        for n, prompt in enumerate(prompts)
    ]
    cpu, wall = time.process_time(), time.perf_counter()
    outputs, completion_tokens = _run(engine, items, params)
    wall_s, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return LoraRun(len(adapters), outputs, completion_tokens, wall_s, cpu_s, _load_seconds(source, adapters))


def _run(engine: TransformersEngine, items: list[Item], params: dict[str, Any]) -> tuple[int, int]:
    """Responses and completion tokens of one pass."""
    outputs = completion_tokens = 0
    for result in run_records(engine, items, params=params, micro_batch_size=micro_batch_size()):
        if result.response is None:
            raise RuntimeError(f"record {result.custom_id} failed: {result.error}")
        outputs += 1
        completion_tokens += result.response["usage"]["completion_tokens"]
    return outputs, completion_tokens


def _load_seconds(source: Path, adapters: list[dict[str, Any]]) -> float:
    """Seconds `LoraAdapters`, the engine's own loader, takes to load ``adapters`` onto a fresh base model."""
    if not adapters:
        return 0.0
    from transformers import AutoModelForCausalLM  # heavy, as in the engine: imported where it is needed

    loader = LoraAdapters(AutoModelForCausalLM.from_pretrained(source).eval())
    start = time.perf_counter()
    for adapter in adapters:
        with loader.active(adapter):
            pass
    return time.perf_counter() - start


def render_lora(bench: LoraBench) -> str:
    header = (
        f"  {'adapters':>8} {'records':>8} {'tokens out':>10} {'seconds':>8} {'CPU s':>7} {'records/s':>10} "
        f"{'vs base':>8} {'loads':>6} {'load s':>7}"
    )
    rows = [
        f"  {'none' if run.adapters == 0 else run.adapters:>8} {run.outputs:>8,} {run.completion_tokens:>10,} "
        f"{run.wall_s:>8.2f} {run.cpu_s:>7.2f} {run.records_per_s:>10.1f} "
        f"{run.records_per_s / bench.base.records_per_s:>8.2f} {run.adapters:>6} {run.load_s:>7.2f}"
        for run in bench.runs
    ]
    return "\n".join(
        [
            f"LoRA adapters: {bench.records:,} prompts (max_tokens {bench.max_tokens}, greedy) through the slot's "
            f"micro-batch loop (micro-batches of {bench.micro_batch_size}), transformers engine, CPU, "
            f"{bench.torch_threads} torch thread(s)",
            f"  one warm base model, warmed up by one run: a GPT-2 of {bench.layers} layers, {bench.width} wide "
            f"({bench.weights_bytes / 1e6:.1f} MB of weights), larger than the tests' so that a record is not all "
            "overhead",
            header,
            *rows,
            "  vs base: records/s over those of the base model alone (first row: no adapter param), same prompts;",
            "  records spread round-robin over the adapters (record i on adapter i % n), each configuration on "
            "adapters of its own;",
            "  seconds include loading them on first use (loads); load s: the same loads timed apart, on a fresh "
            "copy of the base model",
            f"rerun: python manage.py bench --only-lora --lora-records {bench.records}",
        ]
    )
