"""The misbehaving models of the chaos suite, through the python engine; the fatal ones in a subprocess."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuworkers.batching import OUT_OF_MEMORY, run_records
from gpuworkers.engines import Engine, create_engine
from gpuworkers.faults import StickyDeviceError, is_sticky_device_error
from gpuworkers.spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]


def chaos_spec(factory: str) -> ModelSpec:
    return ModelSpec(
        name=f"chaos-{factory}",
        version="1",
        engine="python",
        task="generate",
        source=f"tests.support.chaos_engines:{factory}",
    )


def chaos_engine(factory: str) -> Engine:
    engine = create_engine(chaos_spec(factory))
    engine.load(device="cpu")
    return engine


def items_of(*values: str) -> list[tuple[str, str]]:
    return [(f"id-{index}", value) for index, value in enumerate(values)]


def run_in_subprocess(factory: str, values: list[str]) -> subprocess.Popen[str]:
    """Run ``values`` through the chaos model in a fresh Python, printing ``running`` first."""
    script = textwrap.dedent(
        f"""
        from gpuworkers.batching import run_records
        from gpuworkers.engines import create_engine
        from gpuworkers.spec import ModelSpec

        spec = ModelSpec.from_dict({chaos_spec(factory).to_dict()!r})
        engine = create_engine(spec)
        engine.load(device="cpu")
        print("running", flush=True)
        items = [(str(index), value) for index, value in enumerate({values!r})]
        for result in run_records(engine, items, params={{}}, micro_batch_size=8):
            print(result, flush=True)
        """
    )

    def no_core_dump() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=no_core_dump,
    )


def test_the_echo_model_echoes_each_text_and_its_length() -> None:
    results = list(run_records(chaos_engine("echo_factory"), items_of("a", "hello"), params={}, micro_batch_size=8))

    assert [result.response for result in results] == [{"echo": "a", "length": 1}, {"echo": "hello", "length": 5}]


def test_a_record_that_is_not_text_is_an_engine_error_of_its_own() -> None:
    items = [("id-0", "a"), ("id-1", 7), ("id-2", "c")]

    results = list(run_records(chaos_engine("echo_factory"), items, params={}, micro_batch_size=8))

    assert [result.error["code"] if result.error else None for result in results] == [None, "engine_error", None]


def test_sleep_per_record_slows_the_echo_model_down() -> None:
    engine = chaos_engine("echo_factory")

    started = time.perf_counter()
    engine.run_batch(["a", "b", "c"], {"sleep_per_record": 0.05})

    assert time.perf_counter() - started >= 0.15


def test_the_oom_model_runs_out_of_memory_above_its_character_limit() -> None:
    import torch

    engine = chaos_engine("oom_factory")

    assert engine.run_batch(["x" * 200], {}) == [{"echo": "x" * 200, "length": 200}]
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        engine.run_batch(["x" * 150, "y" * 51], {})
    with pytest.raises(torch.OutOfMemoryError):
        engine.run_batch(["x" * 11], {"oom_above_chars": 10})


def test_out_of_memory_bisection_isolates_only_the_oversized_record() -> None:
    values = ["r" * 60 for _ in range(7)]
    values.insert(4, "X" * 250)

    results = list(run_records(chaos_engine("oom_factory"), items_of(*values), params={}, micro_batch_size=8))

    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(8)]
    assert results[4].response is None
    assert results[4].error is not None
    assert results[4].error["code"] == OUT_OF_MEMORY
    assert results[4].error["message"].startswith("OutOfMemoryError: CUDA out of memory.")
    assert [result.response for index, result in enumerate(results) if index != 4] == [
        {"echo": "r" * 60, "length": 60}
    ] * 7


def test_the_sticky_model_raises_a_sticky_cuda_error_and_stays_broken() -> None:
    engine = chaos_engine("sticky_factory")

    assert engine.run_batch(["fine"], {}) == [{"echo": "fine", "length": 4}]
    with pytest.raises(RuntimeError) as caught:
        engine.run_batch(["a STICKY record"], {})
    assert is_sticky_device_error(caught.value)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.run_batch(["fine"], {})


def test_a_sticky_record_ends_the_run_with_sticky_device_error() -> None:
    engine = chaos_engine("sticky_factory")

    with pytest.raises(StickyDeviceError):
        list(run_records(engine, items_of("a", "STICKY", "c"), params={}, micro_batch_size=8))


def test_the_poison_and_hang_models_echo_records_without_their_marker() -> None:
    for factory in ("poison_factory", "hang_factory"):
        assert chaos_engine(factory).run_batch(["fine"], {}) == [{"echo": "fine", "length": 4}]


def test_a_poison_record_kills_the_process_with_sigabrt() -> None:
    process = run_in_subprocess("poison_factory", ["fine", "a POISON pill", "never reached"])

    stdout, stderr = process.communicate(timeout=20)

    assert process.returncode == -signal.SIGABRT, stderr
    assert stdout.splitlines() == ["running"]


def test_a_hang_record_blocks_until_the_process_is_killed() -> None:
    process = run_in_subprocess("hang_factory", ["fine", "HANG here"])
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "running\n"
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=0.5)
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == -signal.SIGKILL
