"""What a shard's attempt records of how its output was made (`ShardManifest.provenance`): the model's
catalog name and version, its files by digest as this process loaded them, the digest of each set of
params its records set themselves, the engine and the software's versions, and where it ran. The control
side joins the shards' into the job's manifest."""

from __future__ import annotations

import socket
from collections import Counter
from typing import Any

from gpuworkers.batching import Item
from gpuworkers.cache import CacheLookup
from gpuworkers.engines.base import ADAPTER_PARAM, EngineLoadError
from gpuworkers.settings import device, slot_gpu_class
from gpuworkers.versions import software_versions
from tasks.shared.digests import canonical_digest
from tasks.shared.specs import ShardSpec


def shard_provenance(spec: ShardSpec, lookup: CacheLookup, items: list[Item]) -> dict[str, Any]:
    """`items` are the shard's records with the params they set themselves (before the slot gives each that
    samples its seed): counted by the digest of those params."""
    files = lookup.files
    overrides = Counter(
        canonical_digest({name: value for name, value in item.params.items() if name != ADAPTER_PARAM})
        for item in items
        if item.params and any(name != ADAPTER_PARAM for name in item.params)
    )
    return {
        "model": {
            "name": spec.model.name,
            "version": spec.model.version,
            "source": spec.model.source,
            "engine": spec.model.engine,
            "weights_digest": files.digest if files else "",
            "tokenizer_digest": files.tokenizer_digest if files else "",
            "files": files.files if files else {},
        },
        "adapters": {name: adapter.fingerprint for name, adapter in sorted(spec.adapters.items())},
        "record_params": dict(overrides),
        "versions": software_versions(),
        "gpu_class": slot_gpu_class(),
        "host": socket.gethostname(),
        "device": device(),
    }


class OtherWeights(EngineLoadError):
    """The slot holds other weights than those its job was pinned to."""


def pinned_weights_check(spec: ShardSpec, lookup: CacheLookup) -> None:
    """Refuse a shard pinned to weights this process did not load (`ShardSpec.weights_digest`)."""
    held = lookup.files.digest if lookup.files else "weights of unknown digest"
    if spec.weights_digest and held != spec.weights_digest:
        raise OtherWeights(
            f"model {spec.model.name}@{spec.model.version}: this slot holds {held}, not {spec.weights_digest} "
            "the job was pinned to"
        )
