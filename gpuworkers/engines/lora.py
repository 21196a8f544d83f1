"""LoRA adapters on one warm base model, for the transformers engine on the CPU (or a GPU), through PEFT.

The base model is loaded once; each adapter is loaded beside it on first use (from its source, through
the host's weights cache like base weights) and kept, up to `MAX_LORAS` a process, the least recently
used one dropped first. `LoraAdapters.active` makes one adapter (or none: the base model alone) the one
a generation runs with.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.settings import MAX_LORAS
from gpuworkers.sources import resolve_model_source
from gpuworkers.spec import AdapterSpec

WEIGHTS_FILE = "adapter_model.safetensors"


class LoraAdapters:
    """The adapters loaded into one base model (a PEFT model once the first is loaded)."""

    def __init__(self, base: Any) -> None:
        self.model: Any = base
        """What generates: the base model, or the PEFT model wrapping it once an adapter was loaded."""
        self._loaded: OrderedDict[str, AdapterSpec] = OrderedDict()
        self._held: tuple[str, ...] = ()

    @property
    def loaded(self) -> list[str]:
        """Fingerprints (`AdapterSpec.fingerprint`) of the adapters loaded, least recently used first: a
        copy made as each load ends, since the slot's heartbeat thread reads it while shards run."""
        return list(self._held)

    @contextmanager
    def active(self, adapter: Mapping[str, Any] | None) -> Iterator[Any]:
        """The model to generate with, running ``adapter`` (an `AdapterSpec` as a dict), or the base model alone."""
        if adapter is None:
            if not self._loaded:
                yield self.model
                return
            with self.model.disable_adapter():
                yield self.model
            return
        key = self._load(AdapterSpec.from_dict(dict(adapter)))
        self.model.set_adapter(key)
        yield self.model

    def _load(self, spec: AdapterSpec) -> str:
        key = spec.fingerprint
        if key in self._loaded:
            self._loaded.move_to_end(key)
            self._held = tuple(self._loaded)
            return key
        path = resolve_model_source(spec.source)
        if not (path / WEIGHTS_FILE).is_file():
            raise EngineLoadError(
                f"adapter {spec.name!r}: no {WEIGHTS_FILE} in {spec.source} (only safetensors are loaded)"
            )
        try:
            if self._loaded or hasattr(self.model, "peft_config"):
                self.model.load_adapter(str(path), adapter_name=key, is_trainable=False)
            else:
                from peft import PeftModel

                self.model = PeftModel.from_pretrained(self.model, str(path), adapter_name=key, is_trainable=False)
        except Exception as exc:
            raise EngineLoadError(
                f"cannot load adapter {spec.name!r} from {spec.source}: {type(exc).__name__}: {exc}"
            ) from exc
        self.model.eval()
        self._loaded[key] = spec
        # Dropped after the new one is in: PEFT keeps at least one adapter in a PEFT model.
        while len(self._loaded) > MAX_LORAS.read():
            evicted, _ = self._loaded.popitem(last=False)
            self.model.delete_adapter(evicted)
        self._held = tuple(self._loaded)
        return key
