"""The `Engine` protocol and the registry that maps a catalog engine name to its class.

An engine is built once per worker process and model (see `gpuworkers.cache`), loaded on a device,
then fed micro-batches. Engines import torch, transformers or vllm lazily, inside `load`, so that
importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gpuworkers.spec import ModelSpec


class EngineLoadError(Exception):
    """The model cannot be loaded (missing weights, bad config): permanent, retrying will not help."""


class Engine(Protocol):
    """Load once, run many batches, report memory, unload."""

    def load(self, *, device: str) -> None:
        """Load the model's weights onto ``device`` (``cpu``, ``cuda``, ``cuda:0``)."""

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run one micro-batch; return one response dict per input, in input order."""

    def memory_bytes(self) -> int:
        """Bytes the loaded model holds (parameters and buffers), for the cache's budget."""

    def unload(self) -> None:
        """Drop every reference to the model and free its memory."""


_ENGINES: dict[str, str] = {
    "python": "gpuworkers.engines.python:PythonEngine",
    "sentence_transformers": "gpuworkers.engines.sentence_transformers:SentenceTransformersEngine",
    "transformers": "gpuworkers.engines.transformers:TransformersEngine",
    "vllm": "gpuworkers.engines.vllm:VllmEngine",
}


def create_engine(spec: ModelSpec) -> Engine:
    """Build (not load) the engine a catalog entry names."""
    try:
        target = _ENGINES[spec.engine]
    except KeyError:
        raise EngineLoadError(f"unknown engine {spec.engine!r}; known: {', '.join(sorted(_ENGINES))}") from None
    module_name, _, class_name = target.partition(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    engine: Engine = engine_class(spec)
    return engine
