"""The ``python`` engine: any model behind an entry point ``package.module:factory``.

The catalog entry's source names the factory. `load` imports it and calls
``factory(spec=spec, device=device)``, which returns the model: an object with
``run_batch(inputs, params) -> list[dict]`` and, optionally, ``memory_bytes() -> int`` and
``unload()``. The factory reads its own load params from ``spec.load_params``. A factory that uses
torch and imports it only later should call `gpuworkers.settings.apply_torch_threads` itself.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError
from gpuworkers.faults import StickyDeviceError, is_sticky_device_error
from gpuworkers.spec import ModelSpec


class PythonEngine:
    """Delegates to the model an entry point's factory builds; load once per worker process."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._model: Any = None

    def load(self, *, device: str) -> None:
        factory = resolve_entry_point(self.spec.source)
        try:
            model = factory(spec=self.spec, device=device)
        except Exception as exc:
            if is_sticky_device_error(exc):
                raise StickyDeviceError(f"the device's context broke while loading {self.spec.name!r}") from exc
            raise EngineLoadError(
                f"the factory {self.spec.source!r} of {self.spec.name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not callable(getattr(model, "run_batch", None)):
            raise EngineLoadError(
                f"the factory {self.spec.source!r} returned a {type(model).__name__}, which has no run_batch method"
            )
        # Set torch's threads only when the model brought torch in: a torch-free model should not pay
        # seconds to import it.
        if "torch" in sys.modules:
            settings.apply_torch_threads()
        self._model = model

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        responses: list[dict[str, Any]] = self._loaded_model().run_batch(inputs, params)
        return responses

    def memory_bytes(self) -> int:
        memory_bytes = getattr(self._model, "memory_bytes", None)
        return int(memory_bytes()) if callable(memory_bytes) else 0

    def unload(self) -> None:
        if self._model is None:
            return
        unload = getattr(self._model, "unload", None)
        self._model = None
        if callable(unload):
            unload()
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _loaded_model(self) -> Any:
        if self._model is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._model


def resolve_entry_point(source: str) -> Callable[..., Any]:
    """The callable ``package.module:attribute`` names (the attribute may be dotted: ``module:Class.create``)."""
    module_name, colon, attribute_path = source.partition(":")
    if not colon or not module_name or not attribute_path or ":" in attribute_path:
        raise EngineLoadError(f"python engine source {source!r} is not an entry point 'package.module:factory'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        # ImportError for a missing module or one of its imports; anything else from the module's own code.
        raise EngineLoadError(
            f"python engine source {source!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for attribute in attribute_path.split("."):
        try:
            target = getattr(target, attribute)
        except AttributeError:
            raise EngineLoadError(
                f"python engine source {source!r}: {getattr(target, '__name__', module_name)!r} "
                f"has no attribute {attribute!r}"
            ) from None
    if not callable(target):
        raise EngineLoadError(f"python engine source {source!r} names a {type(target).__name__}, not a callable")
    factory: Callable[..., Any] = target
    return factory
