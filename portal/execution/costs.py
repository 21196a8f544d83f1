"""What a shard costs in GPU-seconds: estimated when it is sent, measured when it ends.

Fair share charges the estimate when the shard is sent and corrects it by the measurement when the
shard ends, so that only their difference depends on the estimate's quality.
"""

from __future__ import annotations

from django.conf import settings

from portal.jobs.models import Job, Shard
from tasks.shared.specs import ShardManifest


def shard_cost_estimate(job: Job, shard: Shard) -> float:
    """GPU-seconds the planner expects (from the model's throughput estimate, `portal.catalog.throughput`)."""
    return shard_seconds_estimate(shard) * job.model.gpus_per_replica


def shard_seconds_estimate(shard: Shard | None) -> float:
    """Seconds a replica takes for the shard, as the planner expects them (0 for no shard)."""
    if shard is None:
        return 0.0
    if shard.estimated_seconds is None:  # cut before shards were costed
        return shard.record_count * settings.BATCHERY_DEFAULT_SECONDS_PER_RECORD
    return shard.estimated_seconds


def shard_cost_measured(job: Job, manifest: ShardManifest) -> float:
    """GPU-seconds of the committed attempt, counted as the usage ledger counts them."""
    return (manifest.compute_seconds + manifest.load_seconds) * job.model.gpus_per_replica
