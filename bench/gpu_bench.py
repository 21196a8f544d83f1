"""GPU throughput check: the transformers engine's micro-batch loop against a bare ``model.generate`` loop.

Runs N prompts through `gpuworkers.engines.transformers.TransformersEngine` on ``cuda`` in micro-batches
(`gpuworkers.batching.run_records`, as a shard does), then the same prompts through the bare model in
batches of ``--batch-size`` (the engine's prompts per ``generate`` call too), and prints records/s for
both, their ratio, and the GPU's mean and max utilization during the engine run, sampled with NVML
when nvidia-ml-py is installed. A ratio at or above 1 means the platform's loop costs nothing.

On a GPU host, from the repository root, with the project's virtualenv:

    python -m bench.gpu_bench --model-dir /models/some-causal-lm --records 2000
    python -m bench.gpu_bench --model-dir /tmp/tiny-lm --records 512   # builds a tiny GPT-2 there first

A directory without ``config.json`` gets the tests' tiny GPT-2 built into it. Exits 2 without CUDA.
With ``--vllm`` it also times the vllm engine over the same prompts with one set of params, with each
record's own (as a batch of OpenAI requests gives them), and with structured output on every other record,
printing how many of those replies validate against the schema.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

# Run as a script: `gpuworkers` and `tests.support` are found from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]


def make_prompts(count: int, max_words: int) -> list[str]:
    """``count`` repeatable prompts of 1 to ``max_words`` words, lengths mixed as in a real input file."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + (i * 7) % max_words)) for i in range(count)]


class UtilizationSampler:
    """Samples the GPU's utilization (percent) with NVML from a background thread while in its ``with``."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.samples: list[int] = []
        self.problem: str | None = None
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def __enter__(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            import pynvml
        except ImportError:
            self.problem = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self.problem = f"NVML did not start: {exc}"
            return
        try:
            handle = _nvml_handle(pynvml)
            while not self._stop.is_set():
                self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                self._stop.wait(self._interval_s)
        except pynvml.NVMLError as exc:
            self.problem = f"NVML failed: {exc}"
        finally:
            pynvml.nvmlShutdown()


def _nvml_handle(pynvml: Any) -> Any:
    # torch's cuda:0 is the first GPU of CUDA_VISIBLE_DEVICES; NVML ignores that variable.
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    if first.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(first))
    return pynvml.nvmlDeviceGetHandleByUUID(first)


def run_engine(
    model_dir: Path, prompts: list[str], *, batch_size: int, micro_batch_size: int, max_tokens: int
) -> tuple[float, UtilizationSampler]:
    """Seconds the engine takes for all prompts, and the utilization sampled meanwhile."""
    import torch

    from gpuworkers.batching import run_records
    from gpuworkers.engines.transformers import TransformersEngine
    from gpuworkers.spec import ModelSpec

    spec = ModelSpec(name="gpu-bench", version="1", engine="transformers", task="generate", source=str(model_dir))
    engine = TransformersEngine(spec)
    engine.load(device="cuda")
    params = {"max_tokens": max_tokens, "batch_size": batch_size}
    items = [(str(index), prompt) for index, prompt in enumerate(prompts)]
    try:
        engine.run_batch(prompts[:batch_size], params)  # warm-up: kernels and the caching allocator
        torch.cuda.synchronize()
        with UtilizationSampler() as sampler:
            started = time.perf_counter()
            results = list(run_records(engine, items, params=params, micro_batch_size=micro_batch_size))
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
    finally:
        engine.unload()
    failures = [result.error for result in results if result.error is not None]
    if failures:
        print(f"warning: {len(failures)} records failed in the engine run, e.g. {failures[0]}", file=sys.stderr)
    return elapsed, sampler


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 24}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
}


def line_params(index: int, max_tokens: int, *, structured: bool) -> dict[str, Any]:
    """A record's own params, as a batch of OpenAI requests gives them: limits, temperatures and seeds differ
    from line to line, and with ``structured`` every other reply is held to `SCHEMA`."""
    params: dict[str, Any] = {
        "max_tokens": max_tokens - index % 4,
        "temperature": (index % 3) * 0.4,
        "seed": index,
    }
    if structured and index % 2 == 0:
        params["max_tokens"] = max(max_tokens, 64)
        params["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    return params


def run_vllm(
    model_dir: Path, prompts: list[str], *, micro_batch_size: int, max_tokens: int, per_line: bool, structured: bool
) -> tuple[float, int, int]:
    """Seconds the vllm engine takes for all prompts through `run_records`, one set of params or each record's
    own; and of the replies held to `SCHEMA`, how many there were and how many parse and validate."""
    import json

    import jsonschema

    from gpuworkers.batching import Item, run_records
    from gpuworkers.engines.vllm import VllmEngine
    from gpuworkers.spec import ModelSpec

    spec = ModelSpec(
        name="gpu-bench",
        version="1",
        engine="vllm",
        task="generate",
        source=str(model_dir),
        load_params={"gpu_memory_utilization": 0.5, "enforce_eager": True},
    )
    engine = VllmEngine(spec)
    engine.load(device="cuda")
    items = [
        Item(str(index), prompt, line_params(index, max_tokens, structured=structured) if per_line else None)
        for index, prompt in enumerate(prompts)
    ]
    try:
        engine.run_batch(prompts[:8], {"max_tokens": max_tokens})  # warm-up: CUDA graphs, the grammar backend
        started = time.perf_counter()
        params = {"max_tokens": max_tokens}
        results = list(run_records(engine, items, params=params, micro_batch_size=micro_batch_size))
        elapsed = time.perf_counter() - started
    finally:
        engine.unload()
    held = valid = 0
    for item, result in zip(items, results, strict=True):
        if item.params is None or "response_format" not in item.params:
            continue
        held += 1
        try:
            jsonschema.validate(json.loads((result.response or {}).get("text", "")), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return elapsed, held, valid


def run_bare(model_dir: Path, prompts: list[str], *, batch_size: int, max_tokens: int) -> float:
    """Seconds a plain loop of ``model.generate`` over batches of ``batch_size`` prompts takes (greedy, float16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float16)
    model.to("cuda").eval()

    def generate(batch: list[str]) -> list[str]:
        encoded = tokenizer(batch, return_tensors="pt", padding=True).to("cuda")
        with torch.inference_mode():
            output = model.generate(
                input_ids=encoded["input_ids"],
                attention_mask=encoded["attention_mask"],
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        # Decoded, as the engine decodes: the comparison is record in, text out.
        return list(tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True))

    generate(prompts[:batch_size])  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        generate(prompts[start : start + batch_size])
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    from gpuworkers import settings

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="a causal LM directory (built if empty)")
    parser.add_argument("--records", type=int, default=1024, help="prompts to run (default 1024)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per generate call, both runs (32)")
    parser.add_argument("--micro-batch-size", type=int, default=settings.micro_batch_size(), help="engine records")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt at most (32)")
    parser.add_argument("--max-words", type=int, default=12, help="words in the longest prompt (12)")
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also time the vllm engine: one set of params, each record's own, and each record's own with "
        "structured output on every other one (needs the vllm extra)",
    )
    args = parser.parse_args(argv)
    if min(args.records, args.batch_size, args.micro_batch_size, args.max_tokens, args.max_words) < 1:
        parser.error("--records, --batch-size, --micro-batch-size, --max-tokens and --max-words must be positive")

    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: torch sees no CUDA GPU; run this on a GPU host", file=sys.stderr)
        return 2
    if not (args.model_dir / "config.json").is_file():
        from tests.support.tiny_models import build_tiny_causal_lm

        print(f"no config.json in {args.model_dir}: building the tiny GPT-2 there")
        build_tiny_causal_lm(args.model_dir)

    prompts = make_prompts(args.records, args.max_words)
    print(f"{torch.cuda.get_device_name(0)}: {args.records} records, generate batches of {args.batch_size}, ", end="")
    print(f"engine micro-batches of {args.micro_batch_size}, up to {args.max_tokens} tokens each")
    sizes = {"batch_size": args.batch_size, "max_tokens": args.max_tokens}
    engine_s, sampler = run_engine(args.model_dir, prompts, micro_batch_size=args.micro_batch_size, **sizes)
    bare_s = run_bare(args.model_dir, prompts, **sizes)
    engine_rate, bare_rate = args.records / engine_s, args.records / bare_s
    print(f"engine (run_records): {engine_rate:10.1f} records/s  ({engine_s:.2f} s)")
    print(f"bare model.generate:  {bare_rate:10.1f} records/s  ({bare_s:.2f} s)")
    print(f"ratio engine/bare:    {engine_rate / bare_rate:10.2f}")
    if sampler.samples:
        mean, peak = statistics.fmean(sampler.samples), max(sampler.samples)
        print(f"GPU utilization, engine run: mean {mean:.0f} %, max {peak} % ({len(sampler.samples)} samples)")
    else:
        print(f"GPU utilization: not sampled ({sampler.problem or 'the run was shorter than one sample'})")
    if args.vllm:
        for label, per_line, structured in (
            ("vllm, one set of params:  ", False, False),
            ("vllm, each line's params: ", True, False),
            ("vllm, + structured output:", True, True),
        ):
            seconds, held, valid = run_vllm(
                args.model_dir,
                prompts,
                micro_batch_size=args.micro_batch_size,
                max_tokens=args.max_tokens,
                per_line=per_line,
                structured=structured,
            )
            shown = f"  ({valid}/{held} replies valid against the schema)" if held else ""
            print(f"{label} {args.records / seconds:10.1f} records/s  ({seconds:.2f} s){shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
