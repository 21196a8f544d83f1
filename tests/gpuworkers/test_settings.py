"""Worker-side knobs read from the environment, and loud failures on bad values."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuworkers import settings
from tasks.shared.env import ImproperlyConfiguredEnv


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "BATCHERY_DEVICE",
        "BATCHERY_TORCH_THREADS",
        "BATCHERY_MICRO_BATCH_SIZE",
        "BATCHERY_VLLM_MICRO_BATCH_SIZE",
        "BATCHERY_CACHE_BUDGET_BYTES",
    ):
        monkeypatch.delenv(name, raising=False)


def test_defaults_apply_when_nothing_is_set() -> None:
    assert settings.torch_threads() == 0
    assert settings.micro_batch_size() == 256
    assert settings.cache_budget_bytes("cpu") == 8 * 1024**3


def test_the_vllm_engine_takes_micro_batches_of_its_own_size_and_the_others_the_common_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert (settings.micro_batch_size("vllm"), settings.micro_batch_size("transformers")) == (1024, 256)

    monkeypatch.setenv("BATCHERY_VLLM_MICRO_BATCH_SIZE", "512")
    monkeypatch.setenv("BATCHERY_MICRO_BATCH_SIZE", "64")

    assert (settings.micro_batch_size("vllm"), settings.micro_batch_size("sentence_transformers")) == (512, 64)


def test_auto_device_is_cpu_on_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    assert settings.device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_cpu_slot_is_on_cpu_without_importing_torch() -> None:
    code = "import sys; from gpuworkers.settings import device; print(device(), 'torch' in sys.modules)"
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "BATCHERY_DEVICE": "auto"}

    finished = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)

    assert finished.stdout.split() == ["cpu", "False"]


@pytest.mark.parametrize("value", ["cpu", "cuda", "cuda:1"])
def test_an_explicit_device_is_kept(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BATCHERY_DEVICE", value)

    assert settings.device() == value


def test_values_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_TORCH_THREADS", "1")
    monkeypatch.setenv("BATCHERY_MICRO_BATCH_SIZE", " 64 ")
    monkeypatch.setenv("BATCHERY_CACHE_BUDGET_BYTES", "1_000_000")

    assert settings.torch_threads() == 1
    assert settings.micro_batch_size() == 64
    assert settings.cache_budget_bytes("cpu") == 1_000_000
    assert settings.cache_budget_bytes("cuda:0") == 1_000_000


@pytest.mark.parametrize(
    ("name", "value", "read", "message"),
    [
        ("BATCHERY_DEVICE", "gpu", settings.device, "BATCHERY_DEVICE='gpu' is not one of"),
        (
            "BATCHERY_TORCH_THREADS",
            "two",
            settings.torch_threads,
            "BATCHERY_TORCH_THREADS='two' is not an integer",
        ),
        (
            "BATCHERY_TORCH_THREADS",
            "-1",
            settings.torch_threads,
            "BATCHERY_TORCH_THREADS=-1 is below its minimum",
        ),
        ("BATCHERY_MICRO_BATCH_SIZE", "0", settings.micro_batch_size, "BATCHERY_MICRO_BATCH_SIZE=0 is below"),
    ],
)
def test_a_bad_value_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, read: object, message: str
) -> None:
    monkeypatch.setenv(name, value)

    with pytest.raises(ImproperlyConfiguredEnv, match=message):
        read()  # type: ignore[operator]


def test_a_bad_cache_budget_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_CACHE_BUDGET_BYTES", "8GiB")

    with pytest.raises(ImproperlyConfiguredEnv, match="BATCHERY_CACHE_BUDGET_BYTES='8GiB' is not an integer"):
        settings.cache_budget_bytes("cpu")


def test_the_thread_count_is_applied_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    before = torch.get_num_threads()
    monkeypatch.setenv("BATCHERY_TORCH_THREADS", "1")
    try:
        settings.apply_torch_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
