"""Recognising the CUDA errors after which a worker process cannot go on."""

from __future__ import annotations

import pytest

from gpuworkers.faults import is_sticky_device_error


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "CUDA error: unspecified launch failure",
        "CUDA error: an illegal instruction was encountered",
        "CUDA error: misaligned address",
        "CUDA error: uncorrectable ECC error encountered",
        "NVML: GPU is lost",
        "CUDA driver error: unknown error",
    ],
)
def test_cuda_errors_that_break_the_context_are_sticky(message: str) -> None:
    assert is_sticky_device_error(RuntimeError(message))


def test_torch_accelerator_errors_are_recognised_by_their_text() -> None:
    import torch

    assert is_sticky_device_error(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert not is_sticky_device_error(torch.AcceleratorError("CUDA error: invalid argument"))


def test_a_sticky_error_an_engine_wrapped_is_found_through_its_cause() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as exc:
            raise ValueError("generation failed") from exc
    except ValueError as wrapped:
        assert is_sticky_device_error(wrapped)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("the input is too long"),
        ValueError("cannot handle 'an illegal memory access'"),
        MemoryError(),
    ],
)
def test_ordinary_errors_and_errors_that_only_quote_a_marker_are_not_sticky(exc: Exception) -> None:
    assert not is_sticky_device_error(exc)


def test_running_out_of_memory_is_not_sticky() -> None:
    import torch

    assert not is_sticky_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_a_dead_vllm_engine_is_treated_like_a_broken_device() -> None:
    class EngineDeadError(Exception):
        """Stands in for vllm.v1.engine.exceptions.EngineDeadError."""

    assert is_sticky_device_error(EngineDeadError("EngineCore encountered an issue"))
