"""How a catalog entry's load params become `vllm.LLM`'s arguments, and how a loaded vLLM is torn down: the parts
of the ``vllm`` engine (`gpuworkers.engines.vllm`) that depend on the vLLM version and the slot's GPUs."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Mapping
from typing import Any

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError
from gpuworkers.engines.sampling import is_int
from gpuworkers.engines.vllm_lora import lora_kwargs
from gpuworkers.spec import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_GPU_MEMORY_UTILIZATION = settings.CUDA_CACHE_BUDGET_FRACTION
"""vLLM's share of each GPU when the catalog entry does not set ``gpu_memory_utilization``: the warm
cache's whole budget, since vLLM fills what it is given with KV cache."""

_RESERVED_LOAD_PARAMS = frozenset({"model", "tensor_parallel_size"})


def tensor_parallel_size(spec: ModelSpec, visible_devices: str | None) -> int:
    """GPUs to split the model over: every GPU of the slot (``CUDA_VISIBLE_DEVICES``), else the spec's count.

    Fewer visible GPUs than the model needs is a load error: vLLM would try to fit it on fewer and fail
    later, or run out of memory.
    """
    if visible_devices is None:
        return spec.gpus_per_replica
    devices = [device for device in visible_devices.split(",") if device.strip()]
    if not devices:
        raise EngineLoadError("CUDA_VISIBLE_DEVICES is empty: this worker has no GPU for the vllm engine")
    if len(devices) < spec.gpus_per_replica:
        raise EngineLoadError(
            f"{spec.name!r} needs {spec.gpus_per_replica} GPUs, but CUDA_VISIBLE_DEVICES={visible_devices!r} "
            f"gives this worker {len(devices)}"
        )
    return len(devices)


def embed_runner_kwargs(llm_parameters: Collection[str]) -> dict[str, Any]:
    """The `vllm.LLM` argument that makes it an embedding model, for the vLLM at hand.

    vLLM 0.10 and later take ``runner="pooling"`` (``task`` was deprecated, then removed); 0.6.4 to 0.9
    take ``task="embed"``; older ones pick the pooling runner from the model's architecture alone.
    """
    if "runner" in llm_parameters:
        return {"runner": "pooling"}
    if "task" in llm_parameters:
        return {"task": "embed"}
    return {}


def engine_kwargs(load_params: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments from a catalog entry's load params, checked where Batchery sets a default."""
    reserved = set(load_params) & _RESERVED_LOAD_PARAMS
    if reserved:
        raise EngineLoadError(
            f"load params {', '.join(sorted(reserved))} are set by the vllm engine (from the model's source "
            "and the slot's GPUs), not by the catalog"
        )
    kwargs = dict(load_params)
    # The engine's own (gpuworkers.engines.vllm_tools), not an argument of vllm.LLM.
    kwargs.pop("tool_call_parser", None)
    utilization = kwargs.setdefault("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        raise EngineLoadError(f"gpu_memory_utilization must be a number in (0, 1], not {utilization!r}")
    max_model_len = kwargs.setdefault("max_model_len", None)
    if max_model_len is not None and (not is_int(max_model_len) or max_model_len < 1):
        raise EngineLoadError(f"max_model_len must be a positive integer, not {max_model_len!r}")
    dtype = kwargs.setdefault("dtype", "auto")
    if not isinstance(dtype, str):
        raise EngineLoadError(f"dtype must be a string such as 'auto' or 'bfloat16', not {dtype!r}")
    # vLLM keeps its statistics only when asked; the slot re-exports them on the host's /metrics.
    kwargs.setdefault("disable_log_stats", False)
    # xgrammar: the compiler `grammar_gate` checks each schema with. No free whitespace in structured replies:
    # where a small or sampled model runs away until max_tokens cuts a reply that no longer parses, and tokens
    # nobody reads; OpenAI's structured replies are compact too.
    kwargs.setdefault("structured_outputs_config", {"backend": "xgrammar", "disable_any_whitespace": True})
    lora_kwargs(kwargs)
    return kwargs


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise EngineLoadError(
            f"vLLM is not installed (`make install` puts its CPU build here; a GPU host installs "
            f"'batchery[vllm]'): {exc}"
        ) from exc
    except Exception as exc:
        # vllm imports torch's CUDA extensions at import time; a driver or build mismatch shows here.
        raise EngineLoadError(f"cannot import vllm: {type(exc).__name__}: {exc}") from exc
    return vllm


def parameter_names(callable_: Any) -> set[str]:
    """The names of the parameters `callable_` takes (none where it cannot be inspected): what the vLLM at hand has."""
    try:
        return set(inspect.signature(callable_).parameters)
    except (TypeError, ValueError):
        return set()


def device_share_bytes(utilization: float) -> int:
    """vLLM's share of one of the slot's GPUs, best effort (0 when torch cannot tell).

    One GPU's share, not the sum over the slot: the warm cache's budget is one device's memory, and
    vLLM takes the same share of each GPU it is split over.
    """
    import torch

    try:
        if not torch.cuda.is_available():
            return 0
        total = max(torch.cuda.get_device_properties(index).total_memory for index in range(torch.cuda.device_count()))
    except RuntimeError:
        return 0
    return int(utilization * total)


def destroy_distributed_state() -> None:
    """vLLM's own teardown of its distributed state (``vllm.distributed``), guarded for versions that lack it."""
    try:
        from vllm import distributed
    except ImportError:
        return
    # Older vLLMs lack cleanup_dist_env_and_memory but have the two steps it wraps.
    names = ["cleanup_dist_env_and_memory"]
    if not hasattr(distributed, names[0]):
        names = ["destroy_model_parallel", "destroy_distributed_environment"]
    steps = [getattr(distributed, name, None) for name in names]
    for step in steps:
        if not callable(step):
            continue
        try:
            step()
        except Exception:
            # The model is already unreachable; a failed teardown must not fail the load that evicted it.
            logger.warning("vllm's %s failed after unloading a model", step.__name__, exc_info=True)
