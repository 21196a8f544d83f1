"""LoRA adapters on the vllm engine: a record's adapter as vLLM's ``LoRARequest`` beside its prompt.

vLLM loads an adapter on the first request that names it and keeps up to ``max_loras``; a request is built
once an adapter and a process (its source resolved once, an ``s3://`` one through the host's weights cache),
with a ``lora_int_id`` stable for the process, which vLLM caches adapters by. vLLM reads the adapter's
stored config itself (and applies no PEFT initialisation to the base weights), so its adapters pass the same
allow-list as the transformers engine's first (`gpuworkers.engines.lora.checked_stored_config`): an adapter
stored before registration rebuilt configs is refused here, naming the field, rather than sized by vLLM
from a ``rank_pattern`` it does not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError
from gpuworkers.engines.lora import checked_stored_config
from gpuworkers.sources import resolve_model_source
from gpuworkers.spec import AdapterSpec

DEFAULT_MAX_LORA_RANK = 64
"""vLLM's ``max_lora_rank`` for a model whose catalog entry enables LoRA without saying: it sizes the
adapter slots vLLM reserves, so an adapter of a higher rank needs the load param raised."""


def lora_kwargs(kwargs: dict[str, Any]) -> None:
    """Fill in ``vllm.LLM``'s LoRA arguments a catalog entry that sets ``enable_lora`` leaves out."""
    if kwargs.get("enable_lora"):
        kwargs.setdefault("max_loras", settings.MAX_LORAS.read())
        kwargs.setdefault("max_lora_rank", DEFAULT_MAX_LORA_RANK)


class VllmLoras:
    """The ``LoRARequest`` of each adapter a model's records named in this process."""

    def __init__(self, model: str, load_params: Mapping[str, Any]) -> None:
        self._model = model
        self._enabled = bool(load_params.get("enable_lora"))
        self._max_rank = int(load_params.get("max_lora_rank", DEFAULT_MAX_LORA_RANK))
        self._requests: dict[str, Any] = {}
        self._held: tuple[str, ...] = ()

    @property
    def loaded(self) -> list[str]:
        """Fingerprints of the adapters this process gave vLLM, which keeps them in its LoRA cache (a copy
        made as each is added, since the slot's heartbeat thread reads it while shards run)."""
        return list(self._held)

    def request(self, adapter: Mapping[str, Any] | None) -> Any:
        """vLLM's request for a record's adapter (an `AdapterSpec` as a dict); None for the base model."""
        if adapter is None:
            return None
        if not self._enabled:
            raise EngineLoadError(
                f"model {self._model!r} does not serve LoRA adapters: its catalog entry sets no load param enable_lora"
            )
        spec = AdapterSpec.from_dict(dict(adapter))
        found = self._requests.get(spec.fingerprint)
        if found is None:
            path = resolve_model_source(spec.source)
            try:
                checked_stored_config(path, max_rank=self._max_rank)
            except EngineLoadError as exc:
                raise EngineLoadError(f"adapter {spec.name!r} is refused: {exc}") from None
            from vllm.lora.request import LoRARequest

            found = self._requests[spec.fingerprint] = LoRARequest(spec.fingerprint, len(self._requests) + 1, str(path))
            self._held = tuple(self._requests)
        return found
