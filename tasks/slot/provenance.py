"""What a shard's attempt records of how its output was made (`ShardManifest.provenance`): the model's
catalog name and version, its files by digest as this process loaded them, the engine and the software's
versions, and where it ran. The control side joins the shards' into the job's manifest."""

from __future__ import annotations

import socket
from typing import Any

from gpuworkers.cache import CacheLookup
from gpuworkers.settings import device, slot_gpu_class
from gpuworkers.versions import software_versions
from tasks.shared.specs import ShardSpec


def shard_provenance(spec: ShardSpec, lookup: CacheLookup) -> dict[str, Any]:
    files = lookup.files
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
        "versions": software_versions(),
        "gpu_class": slot_gpu_class(),
        "host": socket.gethostname(),
        "device": device(),
    }
