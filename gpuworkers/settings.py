"""Worker-side knobs, declared once and read from the environment.

Each knob is a function, read when called, so that the launcher can set a slot's environment before
it starts the worker and tests can change it with ``monkeypatch.setenv``. A bad value raises
`SettingsError` naming the variable instead of falling back to a default nobody asked for.

``BATCHERY_DEVICE``
    ``auto`` (default: ``cuda`` when torch sees a GPU, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``.
``BATCHERY_TORCH_THREADS``
    Torch intra-op threads per worker process; 0 (default) leaves torch's default.
``BATCHERY_MICRO_BATCH_SIZE``
    Records per micro-batch handed to an engine; default 256.
``BATCHERY_CACHE_BUDGET_BYTES``
    Bytes the warm model cache may hold; default 8 GiB on CPU, 90 % of the GPU's memory on CUDA.
``BATCHERY_METRICS_PORT``, ``BATCHERY_METRICS_ADDRESS``, ``BATCHERY_METRICS_DIR``
    Where the launcher serves the host's ``/metrics`` (default port 9310 on every interface; 0 serves
    none), and the slots' multiprocess directory (default: a new temporary one, emptied at start).
``BATCHERY_MODEL_CACHE_DIR``, ``BATCHERY_MODEL_CACHE_BYTES``
    Where the host keeps the weights of ``s3://`` model sources (default ``$XDG_CACHE_HOME/batchery/models``,
    else ``~/.cache/batchery/models``) and the disk bytes it may hold there (default 100 GiB).
``BATCHERY_MODEL_DOWNLOAD_PART_BYTES``, ``BATCHERY_MODEL_DOWNLOAD_CONCURRENCY``
    Files larger than the part size (default 64 MiB) are fetched as that many parallel ranged GETs
    (default 8) at a time.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

GIB = 1024**3

CPU_CACHE_BUDGET_BYTES = 8 * GIB
"""The warm cache's budget on CPU when ``BATCHERY_CACHE_BUDGET_BYTES`` is unset."""

CUDA_CACHE_BUDGET_FRACTION = 0.9
"""Share of the GPU's memory the warm cache may fill; the rest is left to activations and the KV cache."""

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


class SettingsError(ValueError):
    """An environment variable holds a value the worker cannot use."""


def env_str(name: str, default: str) -> str:
    """The variable's value stripped of blanks, or ``default`` when it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or default


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """The variable as an int (``1_000`` allowed), or ``default`` when it is unset or blank."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise SettingsError(f"{name}={value} is below the minimum of {minimum}")
    return value


def device() -> str:
    """The torch device this worker runs models on (``BATCHERY_DEVICE``, ``auto`` resolved)."""
    value = env_str("BATCHERY_DEVICE", "auto")
    if not _DEVICE_PATTERN.fullmatch(value):
        raise SettingsError(f"BATCHERY_DEVICE={value!r} is not one of auto, cpu, cuda, cuda:N")
    if value != "auto":
        return value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_threads() -> int:
    """Torch intra-op threads for this process (``BATCHERY_TORCH_THREADS``); 0 leaves torch's default."""
    return env_int("BATCHERY_TORCH_THREADS", 0, minimum=0)


def apply_torch_threads() -> None:
    """Set torch's thread count from ``BATCHERY_TORCH_THREADS``; engines call it before loading.

    Several worker processes share a CPU host, and torch's default of one thread per core in each
    of them makes them fight over the cores (see DESIGN.md: half the throughput).
    """
    threads = torch_threads()
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def micro_batch_size() -> int:
    """Records per micro-batch handed to an engine (``BATCHERY_MICRO_BATCH_SIZE``)."""
    return env_int("BATCHERY_MICRO_BATCH_SIZE", 256, minimum=1)


def cache_budget_bytes(device: str) -> int:
    """Bytes the warm model cache may hold on ``device`` (``BATCHERY_CACHE_BUDGET_BYTES``)."""
    if env_str("BATCHERY_CACHE_BUDGET_BYTES", ""):
        return env_int("BATCHERY_CACHE_BUDGET_BYTES", 0, minimum=1)
    if not device.startswith("cuda"):
        return CPU_CACHE_BUDGET_BYTES
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return int(total * CUDA_CACHE_BUDGET_FRACTION)


DEFAULT_METRICS_PORT = 9310


def metrics_port() -> int:
    """The launcher's /metrics port (``BATCHERY_METRICS_PORT``); 0 turns the endpoint off."""
    return env_int("BATCHERY_METRICS_PORT", DEFAULT_METRICS_PORT, minimum=0)


def metrics_address() -> str:
    return env_str("BATCHERY_METRICS_ADDRESS", "0.0.0.0")


def metrics_dir() -> str:
    """The slots' multiprocess directory; empty: a new temporary directory per launch."""
    return env_str("BATCHERY_METRICS_DIR", "")


MODEL_CACHE_BYTES = 100 * GIB
"""The weight cache's disk budget when ``BATCHERY_MODEL_CACHE_BYTES`` is unset: a few large models."""


def model_cache_dir() -> Path:
    """Where the weights of ``s3://`` model sources are cached on this host (``BATCHERY_MODEL_CACHE_DIR``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchery" / "models"
    return Path(env_str("BATCHERY_MODEL_CACHE_DIR", str(default))).expanduser()


def model_cache_bytes() -> int:
    """Disk bytes the weight cache may hold (``BATCHERY_MODEL_CACHE_BYTES``); entries in use may exceed it."""
    return env_int("BATCHERY_MODEL_CACHE_BYTES", MODEL_CACHE_BYTES, minimum=1)


def model_download_part_bytes() -> int:
    """Size of each ranged GET, and the size above which a file is fetched in parts."""
    return env_int("BATCHERY_MODEL_DOWNLOAD_PART_BYTES", 64 * 1024**2, minimum=1024**2)


def model_download_concurrency() -> int:
    """Ranged GETs of one file in flight at a time."""
    return env_int("BATCHERY_MODEL_DOWNLOAD_CONCURRENCY", 8, minimum=1)
