"""The seed each record of a shard samples with.

Under a job's ``seed``, a record that samples (`gpuworkers.engines.sampling.samples`) draws with a seed of
its own, `record_seed(seed, custom_id)`: what it draws then depends on no other record, nor on the shard or
the micro-batch it lands in, so a job run again with the same seed writes the same bytes whatever its
shard and micro-batch sizes. A record whose own params name a seed (or null: none) samples as it asked;
greedy records keep the job's params, so that they still run together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuworkers.batching import Item, merged_params
from gpuworkers.engines.sampling import record_seed, samples
from tasks.shared.specs import ShardSpec

SEEDED_TASKS = frozenset({"generate", "chat"})


def seeded_items(spec: ShardSpec, items: list[Item], params: Mapping[str, Any]) -> list[Item]:
    """`items` (a shard's records, run with the job's `params`), each that samples under the job's seed
    given its own."""
    seed = params.get("seed")
    if spec.model.task not in SEEDED_TASKS or not isinstance(seed, int) or isinstance(seed, bool):
        return items  # no seed, or one the engine refuses, naming it
    seeded = []
    for item in items:
        own = item.params or {}
        if "seed" in own or not samples(spec.model.engine, merged_params(params, own)):
            seeded.append(item)
        else:
            seeded.append(item._replace(params={**own, "seed": record_seed(seed, item.custom_id)}))
    return seeded
