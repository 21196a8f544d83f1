"""LoRA adapters on one warm base model, for the transformers engine on the CPU (or a GPU), through PEFT.

The base model is loaded once; each adapter is loaded beside it on first use (from its source, through
the host's weights cache like base weights) and kept, up to `MAX_LORAS` a process, the least recently
used one dropped first. `LoraAdapters.active` makes one adapter (or none: the base model alone) the one
a generation runs with.

PEFT never reads an adapter's stored ``adapter_config.json`` as it is: it gets the config rebuilt from the
checked fields (`gpuworkers.engines.lora_config`), as registration stores it, so that an adapter registered
before that check cannot rewrite the base weights either. And after each load the base weights are compared
with their digest taken before the first (`base_digest`): an adapter that changed them is refused
(`BaseWeightsChanged`), and the engine loads its base model again before it runs another record.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.engines.lora_config import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    LoraConfigRefused,
    lora_fields,
    rebuilt_config,
)
from gpuworkers.settings import MAX_LORAS
from gpuworkers.sources import resolve_model_source
from gpuworkers.spec import AdapterSpec

DIGEST_SAMPLES = 1024
"""Values of each base tensor read whole into its digest, at an even stride, beside the sum of all of them."""
_LORA_TENSOR = ".lora_"
_PEFT_PREFIX = "base_model.model."


class BaseWeightsChanged(EngineLoadError):
    """Loading an adapter changed the base model's weights: the adapter is refused, and the engine must load
    its base model again before it runs another record (nothing restores the weights in place)."""


def base_digest(module: Any) -> dict[str, str]:
    """A digest of each base weight of ``module`` (by its name without PEFT's wrapping), LoRA matrices left out.

    Hashing every byte would copy the weights to the host on each adapter load (gigabytes on a GPU); this
    reads each tensor once where it lives instead: a float64 sum of all its values (any change to any
    value moves it) and `DIGEST_SAMPLES` values at an even stride, exact (a change that keeps the sum, such
    as values swapped, shows there), with its shape and dtype. The set of names catches a model whose
    structure changed (layers added or replaced)."""
    import torch

    digests: dict[str, str] = {}
    with torch.no_grad():
        for name, tensor in module.named_parameters():
            if _LORA_TENSOR in name:
                continue
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // DIGEST_SAMPLES)
            sample = flat[::step][:DIGEST_SAMPLES].to(device="cpu", dtype=torch.float64)
            total = float(torch.sum(flat, dtype=torch.float64).item()) if flat.numel() else 0.0
            digest = hashlib.sha256(f"{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            digest.update(struct.pack("<d", total))
            digest.update(sample.numpy().tobytes())
            digests[name.removeprefix(_PEFT_PREFIX).replace(".base_layer", "")] = digest.hexdigest()
    return digests


def checked_stored_config(path: Path, *, max_rank: int | None = None) -> dict[str, Any]:
    """The config to load the adapter in ``path`` with: its stored config's checked fields, rebuilt for the
    modules and ranks its weights hold (read from the safetensors header alone); raises `EngineLoadError`
    naming the field a stored config may not set.

    Without ``max_rank`` the ranks are bounded by the weights alone: the rebuilt config gives each module the
    rank of its matrices, so the file's size (bounded at registration) bounds what PEFT allocates."""
    from safetensors import safe_open

    try:
        with (path / CONFIG_FILE).open("rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise EngineLoadError(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
        config = json.loads(raw)
        if not isinstance(config, dict):
            raise EngineLoadError(f"{CONFIG_FILE} does not hold a JSON object")
        fields = lora_fields(config, max_rank=max_rank)
        ranks: dict[str, int] = {}
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
                if key.startswith(_PEFT_PREFIX) and key.endswith(".lora_A.weight"):
                    module = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
                    ranks[module] = weights.get_slice(key).get_shape()[0]
        return rebuilt_config(fields, ranks)
    except LoraConfigRefused as exc:
        raise EngineLoadError(exc.message) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise EngineLoadError(f"{CONFIG_FILE} cannot be read: {type(exc).__name__}: {exc}") from None


def adapter_config(path: Path) -> Any:
    """PEFT's `LoraConfig` for the adapter in ``path``, from `checked_stored_config`, never the stored file."""
    from peft import LoraConfig

    return LoraConfig(**checked_stored_config(path))


class LoraAdapters:
    """The adapters loaded into one base model (a PEFT model once the first is loaded)."""

    def __init__(self, base: Any) -> None:
        self.model: Any = base
        """What generates: the base model, or the PEFT model wrapping it once an adapter was loaded."""
        self._base = base
        self._digest: dict[str, str] | None = None
        self._loaded: OrderedDict[str, AdapterSpec] = OrderedDict()
        self._held: tuple[str, ...] = ()
        self.refused: dict[str, str] = {}
        """Why each adapter (by fingerprint) that changed the base weights was refused: answered again without
        loading it, since each try costs the engine a reload of its base model."""

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
        if key in self.refused:
            raise EngineLoadError(self.refused[key])
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
            config = adapter_config(path)
        except EngineLoadError as exc:
            raise EngineLoadError(f"adapter {spec.name!r} is refused: {exc}") from None
        if self._digest is None:
            self._digest = base_digest(self._base)
        try:
            if self._loaded or hasattr(self.model, "peft_config"):
                # With the config added first, PEFT loads the weights only and never reads the stored config.
                self.model.add_adapter(key, config)
                self.model.load_adapter(str(path), adapter_name=key, is_trainable=False)
            else:
                from peft import PeftModel

                self.model = PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=key, is_trainable=False, config=config
                )
        except Exception as exc:
            # A load that failed half-way may have acted on the base weights all the same.
            self._check_base(spec)
            raise EngineLoadError(
                f"cannot load adapter {spec.name!r} from {spec.source}: {type(exc).__name__}: {exc}"
            ) from exc
        self._check_base(spec)
        self.model.eval()
        self._loaded[key] = spec
        # Dropped after the new one is in: PEFT keeps at least one adapter in a PEFT model.
        while len(self._loaded) > MAX_LORAS.read():
            evicted, _ = self._loaded.popitem(last=False)
            self.model.delete_adapter(evicted)
        self._held = tuple(self._loaded)
        return key

    def _check_base(self, spec: AdapterSpec) -> None:
        assert self._digest is not None  # taken before the first adapter was loaded
        now = base_digest(self._base)
        if now == self._digest:
            return
        changed = sorted(name for name in self._digest.keys() | now.keys() if self._digest.get(name) != now.get(name))
        reason = (
            f"adapter {spec.name!r} is refused: loading it changed the base model's weights "
            f"({len(changed)} tensor(s), e.g. {', '.join(changed[:3])}); the slot reloads its base model"
        )
        self.refused[spec.fingerprint] = reason
        raise BaseWeightsChanged(reason)
