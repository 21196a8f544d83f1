"""The LoRA adapters benchmark at a tiny size: the base model alone, then each adapter count, every record answered;
the environment and torch's threads as they were afterwards."""

from __future__ import annotations

import os

import torch

from bench.lora import render_lora, run_lora_bench
from gpuworkers.settings import MAX_LORAS, TORCH_THREADS


def test_the_lora_bench_runs_the_base_model_then_each_adapter_count_on_the_same_records() -> None:
    environment = {name: os.environ.get(name) for name in (MAX_LORAS.name, TORCH_THREADS.name)}
    threads = torch.get_num_threads()

    bench = run_lora_bench(records=12, adapter_counts=(1, 3), max_tokens=2, layers=2, width=32)

    assert [run.adapters for run in bench.runs] == [0, 1, 3]
    assert [run.outputs for run in bench.runs] == [12, 12, 12]
    assert bench.base.load_s == 0 and all(run.load_s > 0 for run in bench.runs[1:])
    assert bench.torch_threads == 1
    assert {name: os.environ.get(name) for name in environment} == environment
    assert torch.get_num_threads() == threads
    table = render_lora(bench)
    assert "records/s" in table and "vs base" in table
