"""Memory bookkeeping shared by the torch engines: what a model holds, and giving it back."""

from __future__ import annotations

import gc
from typing import Any


def module_bytes(module: Any) -> int:
    """Bytes held by a torch module's parameters and buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def release_memory() -> None:
    """After the last reference to a model is dropped: collect it and hand CUDA's cached blocks back."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
