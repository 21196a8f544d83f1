"""How well a vLLM slot keeps its engine fed (`manage.py bench --only-vllm`): the same chat requests through the vllm
engine one micro-batch at a time (each read back before the next goes in, as `LLM.chat` takes them) and queued
ahead (the slot's micro-batch loop, `gpuworkers.batching.run_records`, which submits the next micro-batch before it
reads the last). Each side prints its rate and the requests vLLM's engine held at a step on average: its batch,
which one micro-batch at a time drains at each micro-batch's end. Requests ask for 8 to 32 tokens (greedy), so that
they finish at different steps, as a real batch's replies do.

Both sides run in one process, on one engine, on the same requests (prefix caching off, so that neither is served
by the other's cache), one after the other. Run as ``python -m bench.vllm_feed MODEL_DIR REQUESTS`` (a process of
its own: vLLM sets up its logging and platform in the process that loads it); prints one JSON line.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.prefix import WORDS
from gpuworkers.batching import Item, run_records
from gpuworkers.engines.vllm import VllmEngine
from gpuworkers.engines.vllm_platform import backend
from gpuworkers.settings import micro_batch_size
from gpuworkers.spec import ModelSpec

MAX_TOKENS = (8, 32)


@dataclass(frozen=True)
class FeedRun:
    label: str
    seconds: float
    requests: int
    completion_tokens: int
    held_per_step: float
    """Requests vLLM's engine held (running or waiting) at a step, on average."""
    steps: int


def chat_items(count: int, seed: int = 0) -> list[Item]:
    rng = random.Random(seed)
    return [
        Item(
            f"request-{n}",
            [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))}],
            {"max_tokens": rng.randint(*MAX_TOKENS)},
        )
        for n in range(count)
    ]


def run_feed_bench(model_dir: Path, requests: int, *, load_params: dict[str, Any]) -> list[FeedRun]:
    spec = ModelSpec(
        name="bench-vllm-feed",
        version="1",
        engine="vllm",
        task="chat",
        source=str(model_dir),
        load_params={**load_params, "enable_prefix_caching": False},
    )
    engine = VllmEngine(spec)
    engine.load(device="cpu" if backend() == "cpu" else "cuda")
    try:
        items = chat_items(requests)
        params = {"temperature": 0}
        chunk = micro_batch_size("vllm")
        engine.run_requests([item.value for item in items[:8]], [params] * 8)  # warm-up

        def one_at_a_time() -> list[dict[str, Any]]:
            return [
                response
                for start in range(0, len(items), chunk)
                for response in engine.run_requests(
                    [item.value for item in items[start : start + chunk]],
                    [{**params, **(item.params or {})} for item in items[start : start + chunk]],
                )
            ]

        def queued_ahead() -> list[dict[str, Any]]:
            return [
                result.response or {} for result in run_records(engine, items, params=params, micro_batch_size=chunk)
            ]

        # Each side twice, alternating, so that neither gains from running second on a machine whose load changes.
        return [
            _timed(engine, label, run)
            for _ in range(2)
            for label, run in (
                (f"one micro-batch of {chunk:,} at a time", one_at_a_time),
                (f"queued ahead, micro-batches of {chunk:,} (the slot)", queued_ahead),
            )
        ]
    finally:
        engine.unload()


def _timed(engine: VllmEngine, label: str, run: Callable[[], list[dict[str, Any]]]) -> FeedRun:
    steps, held = engine.occupancy.steps, engine.occupancy.requests
    started = time.perf_counter()
    responses = run()
    seconds = time.perf_counter() - started
    steps = engine.occupancy.steps - steps
    return FeedRun(
        label=label,
        seconds=seconds,
        requests=len(responses),
        completion_tokens=sum(response.get("usage", {}).get("completion_tokens", 0) for response in responses),
        held_per_step=(engine.occupancy.requests - held) / steps if steps else 0.0,
        steps=steps,
    )


def render_feed(runs: list[FeedRun]) -> str:
    lines = [
        "the engine kept fed: the same chat requests (8 to 32 tokens each) through one vllm engine",
        f"  {'':<48} {'seconds':>8} {'req/s':>8} {'tokens/s':>9} {'held/step':>10} {'steps':>7}",
    ]
    for run in runs:
        lines.append(
            f"  {run.label:<48} {run.seconds:>8.2f} {run.requests / run.seconds:>8.1f} "
            f"{run.completion_tokens / run.seconds:>9.1f} {run.held_per_step:>10.1f} {run.steps:>7,}"
        )
    ratios = [f"{first.seconds / second.seconds:.2f}" for first, second in zip(runs[::2], runs[1::2], strict=False)]
    lines.append(f"  queued ahead / one at a time (requests/s), each round: {', '.join(ratios)}")
    return "\n".join(lines)


def run_feed_child(
    model_dir: Path, requests: int, *, load_params: dict[str, Any], environment: dict[str, str]
) -> list[FeedRun]:
    """`run_feed_bench` in a process of its own, in the slot's `environment`."""
    finished = subprocess.run(
        [sys.executable, "-m", "bench.vllm_feed", str(model_dir), str(requests), json.dumps(load_params)],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    if finished.returncode:
        raise RuntimeError(f"the feed benchmark failed: {finished.stderr[-3000:]}")
    return [FeedRun(**run) for run in json.loads(finished.stdout.strip().splitlines()[-1])]


def main(argv: list[str]) -> None:
    model_dir, requests, load_params = Path(argv[0]), int(argv[1]), json.loads(argv[2]) if len(argv) > 2 else {}
    print(json.dumps([asdict(run) for run in run_feed_bench(model_dir, requests, load_params=load_params)]))


if __name__ == "__main__":
    main(sys.argv[1:])
