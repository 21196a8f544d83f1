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


class TorchModelHolder:
    """What the torch engines share: the loaded module (and tokenizer, where there is one), what it takes,
    and letting go of it (the `Engine` protocol's `memory_bytes` and `unload`)."""

    _model: Any = None
    _tokenizer: Any = None

    def memory_bytes(self) -> int:
        return 0 if self._model is None else module_bytes(self._model)

    def unload(self) -> None:
        if self._model is None:
            return
        self._model = self._tokenizer = None
        release_memory()
