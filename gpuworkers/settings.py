"""A GPU host's settings: each environment variable its launcher, slots and engines read, declared here
once (`tasks.shared.env`: its type, default and meaning) and read when called, so that the launcher can
set a slot's environment before it starts the worker and tests can change it with ``monkeypatch.setenv``.
A bad value raises `ImproperlyConfiguredEnv` naming the variable instead of falling back to a default
nobody asked for.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tasks.shared.env import ImproperlyConfiguredEnv, int_var, list_var, str_var

GIB = 1024**3

CPU_CACHE_BUDGET_BYTES = 8 * GIB
"""The warm cache's budget on CPU when ``BATCHERY_CACHE_BUDGET_BYTES`` is unset."""

CUDA_CACHE_BUDGET_FRACTION = 0.9
"""Share of the GPU's memory the warm cache may fill; the rest is left to activations and the KV cache."""

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")

DEVICE = str_var(
    "BATCHERY_DEVICE", "auto", doc="`auto` (cuda where torch sees a GPU, else cpu), `cpu`, `cuda` or `cuda:N`."
)
TORCH_THREADS = int_var(
    "BATCHERY_TORCH_THREADS", 0, minimum=0, doc="Torch intra-op threads a worker process; 0 leaves torch's default."
)
MAX_LORAS = int_var(
    "BATCHERY_MAX_LORAS",
    8,
    minimum=1,
    doc="LoRA adapters a slot keeps loaded beside its base model; past it the least recently used is dropped.",
)
MICRO_BATCH_SIZE = int_var(
    "BATCHERY_MICRO_BATCH_SIZE",
    256,
    minimum=1,
    doc="Records a micro-batch handed to an engine other than vllm (`BATCHERY_VLLM_MICRO_BATCH_SIZE`).",
)
# vLLM drains its running batch at the end of each call: with micro-batches no larger than its scheduler's batch
# (`max_num_seqs`: 256 on CPU, 1,024 on an H100) its every step ran part-empty as a call ended. Four of them a call
# ran 5,000 chat requests 1.2 to 1.7 times as fast on vLLM's CPU build (`manage.py bench --only-vllm`); 2,048 was
# no faster and 5,000 in one call slower (its prompts are all rendered before the engine starts).
VLLM_MICRO_BATCH_SIZE = int_var(
    "BATCHERY_VLLM_MICRO_BATCH_SIZE",
    1024,
    minimum=1,
    doc="Records a micro-batch handed to the vllm engine, in one vLLM call: several of its scheduler's batches, "
    "so that it drains once a call.",
)
CACHE_BUDGET_BYTES = int_var(
    "BATCHERY_CACHE_BUDGET_BYTES",
    0,
    minimum=1,
    default_text="8 GiB on CPU, 90 % of the GPU's memory on CUDA",
    doc="Bytes the warm model cache may hold.",
)
PREFIX_MIN_TOKENS = int_var(
    "BATCHERY_PREFIX_MIN_TOKENS",
    32,
    minimum=0,
    doc="Fewest prompt tokens the transformers engine computes once for several records that share them "
    "(rounded up to whole blocks of 16); 0 turns prefix reuse off.",
)
PREFIX_CACHE_BYTES = int_var(
    "BATCHERY_PREFIX_CACHE_BYTES",
    256 * 1024**2,
    minimum=0,
    doc="Bytes of shared prefixes' KV caches the transformers engine keeps for later micro-batches and shards "
    "(least recently used out first); 0 shares a prefix within a micro-batch only.",
)
VLLM_CPU_KV_CACHE_BYTES = int_var(
    "BATCHERY_VLLM_CPU_KV_CACHE_BYTES",
    512 * 1024**2,
    minimum=16 * 1024**2,
    doc="Bytes of KV cache a model on vLLM's CPU build holds (a catalog entry's `kv_cache_memory_bytes` wins); "
    "vLLM's own default takes most of the host's memory.",
)
METRICS_PORT = int_var("BATCHERY_METRICS_PORT", 9310, minimum=0, doc="The launcher's /metrics port; 0 serves none.")
METRICS_ADDRESS = str_var("BATCHERY_METRICS_ADDRESS", "0.0.0.0", doc="The address the launcher's /metrics listens on.")
METRICS_DIR = str_var(
    "BATCHERY_METRICS_DIR",
    doc="The slots' multiprocess metrics directory; unset, a new temporary one (emptied at start).",
)
MODEL_CACHE_DIR = str_var(
    "BATCHERY_MODEL_CACHE_DIR",
    default_text="`$XDG_CACHE_HOME/batchery/models`, else `~/.cache/batchery/models`",
    doc="Where a GPU host keeps the weights of s3:// model sources.",
)
MODEL_DOWNLOAD_PART_BYTES = int_var(
    "BATCHERY_MODEL_DOWNLOAD_PART_BYTES",
    64 * 1024**2,
    minimum=1024**2,
    doc="Weight files larger than this are fetched as ranged GETs of this size.",
)
MODEL_DOWNLOAD_CONCURRENCY = int_var(
    "BATCHERY_MODEL_DOWNLOAD_CONCURRENCY", 8, minimum=1, doc="Ranged GETs of one weight file in flight at a time."
)
S3_MAX_ATTEMPTS = int_var("BATCHERY_S3_MAX_ATTEMPTS", 5, minimum=1, doc="Attempts of each S3 call of a GPU host.")
LOG_FORMAT = str_var("BATCHERY_LOG_FORMAT", "text", doc="`text`, or `json`: one JSON object a line.")
# Set by the launcher for each slot it starts (`gpuworkers.slots`).
SLOT = str_var("BATCHERY_SLOT", doc="Set by the launcher: the slot's name; unset, a process is no slot.")
GPU_CLASS = str_var("BATCHERY_GPU_CLASS", doc="Set by the launcher: the GPU class its slots serve.")
WORKER_NAME = str_var(
    "BATCHERY_WORKER_NAME", doc="Set by the launcher: the slot's Celery node name, by which a drain addresses it."
)
QUEUE = str_var("BATCHERY_QUEUE", doc="Set by the launcher: the queue the slot consumes.")
OWN_QUEUE = str_var(
    "BATCHERY_OWN_QUEUE",
    doc="Set by the launcher: the slot's own queue, consumed beside QUEUE (`tasks.shared.config.slot_own_queue`).",
)
PRELOAD = list_var(
    "BATCHERY_PRELOAD", doc="Set by the launcher (`--preload`): models a slot loads before it takes shards."
)


def device() -> str:
    """The torch device this worker runs models on (``BATCHERY_DEVICE``, ``auto`` resolved)."""
    value = DEVICE.read()
    if not _DEVICE_PATTERN.fullmatch(value):
        raise ImproperlyConfiguredEnv(f"BATCHERY_DEVICE={value!r} is not one of auto, cpu, cuda, cuda:N")
    if value != "auto":
        return value
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        # A cpu slot (the launcher hides every GPU from it): no need to import torch (a second or more) to ask it,
        # in each fresh pool process, within its first shard's time limit.
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_threads() -> int:
    """Torch intra-op threads for this process (``BATCHERY_TORCH_THREADS``); 0 leaves torch's default."""
    return TORCH_THREADS.read()


def apply_torch_threads() -> None:
    """Set torch's thread count from ``BATCHERY_TORCH_THREADS``; engines call it before loading.

    Several worker processes share a CPU host, and torch's default of one thread per core in each
    of them makes them fight over the cores (see DESIGN.md: half the throughput).
    """
    threads = torch_threads()
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def micro_batch_size(engine: str | None = None) -> int:
    """Records per micro-batch handed to `engine`: ``BATCHERY_VLLM_MICRO_BATCH_SIZE`` for ``vllm``,
    ``BATCHERY_MICRO_BATCH_SIZE`` for any other (or none named)."""
    return VLLM_MICRO_BATCH_SIZE.read() if engine == "vllm" else MICRO_BATCH_SIZE.read()


def prefix_min_tokens() -> int:
    """Fewest shared prompt tokens worth computing once (``BATCHERY_PREFIX_MIN_TOKENS``); 0: no reuse."""
    return PREFIX_MIN_TOKENS.read()


def prefix_cache_bytes() -> int:
    """Bytes of prefix KV caches an engine keeps across micro-batches (``BATCHERY_PREFIX_CACHE_BYTES``)."""
    return PREFIX_CACHE_BYTES.read()


def cache_budget_bytes(device: str) -> int:
    """Bytes the warm model cache may hold on ``device`` (``BATCHERY_CACHE_BUDGET_BYTES``)."""
    if CACHE_BUDGET_BYTES.is_set():
        return CACHE_BUDGET_BYTES.read()
    if not device.startswith("cuda"):
        return CPU_CACHE_BUDGET_BYTES
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return int(total * CUDA_CACHE_BUDGET_FRACTION)


def vllm_cpu_kv_cache_bytes() -> int:
    """Bytes of KV cache for a model on vLLM's CPU build (``BATCHERY_VLLM_CPU_KV_CACHE_BYTES``)."""
    return VLLM_CPU_KV_CACHE_BYTES.read()


def metrics_port() -> int:
    """The launcher's /metrics port (``BATCHERY_METRICS_PORT``); 0 turns the endpoint off."""
    return METRICS_PORT.read()


def metrics_address() -> str:
    return METRICS_ADDRESS.read()


def metrics_dir() -> str:
    """The slots' multiprocess directory; empty: a new temporary directory per launch."""
    return METRICS_DIR.read()


MODEL_CACHE_BYTES_VAR = int_var(
    "BATCHERY_MODEL_CACHE_BYTES", 100 * GIB, minimum=1, doc="Disk bytes the weight cache may hold (a few large models)."
)


def model_cache_dir() -> Path:
    """Where the weights of ``s3://`` model sources are cached on this host (``BATCHERY_MODEL_CACHE_DIR``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchery" / "models"
    return Path(MODEL_CACHE_DIR.read(default=str(default))).expanduser()


def model_cache_bytes() -> int:
    """Disk bytes the weight cache may hold (``BATCHERY_MODEL_CACHE_BYTES``); entries in use may exceed it."""
    return MODEL_CACHE_BYTES_VAR.read()


def model_download_part_bytes() -> int:
    """Size of each ranged GET, and the size above which a file is fetched in parts."""
    return MODEL_DOWNLOAD_PART_BYTES.read()


def model_download_concurrency() -> int:
    """Ranged GETs of one file in flight at a time."""
    return MODEL_DOWNLOAD_CONCURRENCY.read()


def s3_max_attempts() -> int:
    return S3_MAX_ATTEMPTS.read()


def slot_name() -> str:
    """The slot this process runs ("" where it is no slot: a plain worker, the portal)."""
    return SLOT.read()


def slot_gpu_class() -> str:
    return GPU_CLASS.read()


def slot_worker_name() -> str:
    return WORKER_NAME.read()


def slot_queue() -> str:
    return QUEUE.read()


def slot_own_queue() -> str:
    """The slot's own queue ("" where it consumes none: a plain worker)."""
    return OWN_QUEUE.read()


def preload_references() -> list[str]:
    """The models this slot loads at its start (`name` or `name@version`)."""
    return PRELOAD.read()
