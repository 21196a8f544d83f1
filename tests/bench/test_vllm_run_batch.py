"""`vllm run-batch` as the vLLM benchmark runs it: the slot's engine settings as its flags, the slot's environment
as its own, and an OpenAI batch output file read back."""

from __future__ import annotations

import json
import os

import pytest

from bench.vllm_run_batch import CpuUse, read_answers, run_batch_flags, slot_engine_kwargs, slot_environment
from gpuworkers.engines.vllm_platform import CPU_ENVIRONMENT
from gpuworkers.settings import VLLM_CPU_KV_CACHE_BYTES
from gpuworkers.slots import Slot


def test_the_slots_engine_settings_become_run_batchs_flags() -> None:
    flags = run_batch_flags(
        {
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "disable_log_stats": False,
            "max_model_len": None,
            "block_size": 32,
            "structured_outputs_config": {"backend": "xgrammar"},
        }
    )

    assert flags == [
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--block-size",
        "32",
        "--structured-outputs-config",
        '{"backend": "xgrammar"}',
    ]


def test_the_cpu_engine_settings_are_the_slots_and_leave_this_process_environment_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in CPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(VLLM_CPU_KV_CACHE_BYTES.name, str(64 * 1024**2))

    kwargs = slot_engine_kwargs({"block_size": 32, "max_model_len": 512}, on_cpu=True)

    assert kwargs["kv_cache_memory_bytes"] == 64 * 1024**2
    assert kwargs["distributed_executor_backend"] == "uni" and kwargs["enforce_eager"] is True
    assert kwargs["enable_prefix_caching"] is True and kwargs["tensor_parallel_size"] == 1
    assert (kwargs["block_size"], kwargs["max_model_len"], kwargs["dtype"]) == (32, 512, "auto")
    assert not set(CPU_ENVIRONMENT) & set(os.environ)


def test_run_batch_gets_the_slots_threads_and_keeps_an_operators_own_vllm_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)

    environment = slot_environment(Slot(index=0, gpu_class="cpu", gpus=(), torch_threads=2))

    assert environment["OMP_NUM_THREADS"] == "2"
    assert environment["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert environment["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert environment["HF_HUB_OFFLINE"] == "1"


def test_an_output_file_is_counted_from_its_own_usage_and_errors() -> None:
    def answered(custom_id: str, text: str, completion: int) -> str:
        body = {
            "choices": [{"message": {"content": text}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": completion},
        }
        return json.dumps({"custom_id": custom_id, "response": {"status_code": 200, "body": body}, "error": None})

    refused = json.dumps({"custom_id": "c", "response": {"status_code": 400, "body": None}, "error": "bad request"})

    answers = read_answers([answered("a", "yes", 16), answered("b", "no", 3), refused, ""])

    assert (answers.succeeded, answers.errors) == (2, 1)
    assert (answers.completion_tokens, answers.prompt_tokens) == (19, 14)
    assert answers.texts == {"a": "yes", "b": "no"}


def test_the_rest_of_the_machine_is_what_it_kept_busy_beyond_the_sides_own_cpu() -> None:
    assert CpuUse(wall_s=10.0, own_s=12.0, machine_s=17.0).others_cores == 0.5
    assert CpuUse(wall_s=10.0, own_s=12.0, machine_s=11.0).others_cores == 0.0
