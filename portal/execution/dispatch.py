"""Dispatch mechanics: what a shard's message holds and how it is sent (which, and when, is the scheduler's).

Each shard task goes to the queue of its model's GPU class and size, with its job's priority and
with time limits derived from the model and the shard size, each time with a new task id.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from django.db.models import CharField, Value
from django.db.models.functions import Cast, Concat

from gpuworkers.spec import AdapterSpec
from portal.jobs.models import Job, Shard, ShardStatus
from portal.jobs.storage_layout import job_root, pause_marker_uri
from tasks import send
from tasks.shared.config import SHARD_HARD_TIME_LIMIT_S, gpu_queue, message_priority
from tasks.shared.formats.records import input_field_for
from tasks.shared.specs import ShardSpec

DEFAULT_TIME_LIMIT_BASE_S = 120.0
DEFAULT_TIME_LIMIT_PER_RECORD_S = 1.0


def shard_spec(job: Job, shard: Shard) -> ShardSpec:
    return ShardSpec(
        job_id=str(job.id),
        shard_index=shard.index,
        record_count=shard.record_count,
        input_uri=shard.input_uri,
        shard_prefix=shard.prefix_uri,
        model=job.model.to_spec(),
        input_field=input_field_for(job.model.task),
        params={**job.model.default_params, **job.params},
        hold_uri=pause_marker_uri(job_root(job)),
        # A retry round's Parquet output is converted from the stitched JSONL, so its pieces would go unread.
        output_format=job.output_format if shard.round == 0 else "jsonl",
        adapters={name: AdapterSpec.from_dict(entry["spec"]) for name, entry in job.adapters.items()},
        adapter=job.adapter_name,
        weights_digest=job.model_digest,
    )


def shard_time_limits(job: Job, shard: Shard) -> tuple[float, float]:
    """(soft, hard) seconds: a base plus a cost per record, from the model's defaults, capped so
    that the broker's visibility timeout always outlasts the hard limit."""
    params = {**job.model.default_params, **job.params}
    base = float(params.get("time_limit_base_s", DEFAULT_TIME_LIMIT_BASE_S))
    per_record = float(params.get("time_limit_per_record_s", DEFAULT_TIME_LIMIT_PER_RECORD_S))
    hard = min(base + per_record * shard.record_count, float(SHARD_HARD_TIME_LIMIT_S))
    return hard * 0.9, hard


def shards_send(job: Job, shards: Sequence[Shard], *, copies: bool = False, wave: int = 1) -> None:
    """Send shards the scheduler claimed (marked dispatched, with their task ids) in waves of up to
    `wave` shards (`capacity.wave_for`); with `copies`, their speculative copies
    (under `speculative_task_id`), each alone.

    A wave of several shards is one message (`run_shards`, under `wave_task_id` of its first shard's id),
    each shard under its own soft time limit; a lone shard is a `run_shard` message under its task id.
    Either is a chord of that one message whose callback and error callback are both `shard_done`,
    naming the wave's shards (`tasks.send.send_shard_chord`). A shard the scheduler routed to a slot
    (`Shard.slot_queue`) goes to that slot's own queue, in a wave of its own with the others routed there;
    a copy always goes to the class queue, where another slot takes it.
    """
    queue = job_queue(job)
    priority = message_priority(effective_priority(job))
    size = 1 if copies else max(1, wave)
    targets: dict[str, list[Shard]] = {}
    for shard in shards:
        targets.setdefault("" if copies else shard.slot_queue, []).append(shard)
    for target, routed in targets.items():
        for start in range(0, len(routed), size):
            _send_wave(
                job, routed[start : start + size], queue=queue, target=target or queue, priority=priority, copies=copies
            )


def _send_wave(job: Job, members: Sequence[Shard], *, queue: str, target: str, priority: int, copies: bool) -> None:
    """One message of `shards_send` on `target` (the class `queue`, or a slot's own); its callback settles on
    the class queue's behalf."""
    limits = [shard_time_limits(job, shard) for shard in members]
    specs = [shard_spec(job, shard).to_dict() for shard in members]
    if len(members) == 1:
        [spec], [(soft, hard)] = specs, limits
        task_id = members[0].speculative_task_id if copies else members[0].task_id
        header = send.shard_signature(
            spec,
            task_id=task_id,
            argsrepr=repr(shard_named(spec)),
            limits=send.ShardLimits(target, priority, soft, hard),
        )
    else:
        # Each shard keeps its own soft limit inside the wave; the wave's are the sum, a backstop.
        hard = min(sum(shard_hard for _, shard_hard in limits), float(SHARD_HARD_TIME_LIMIT_S))
        named = ({"job_id": str(job.id), "shard_indexes": [shard.index for shard in members]},)
        header = send.wave_signature(
            [[shard.task_id, spec, limit[0]] for shard, spec, limit in zip(members, specs, limits, strict=True)],
            task_id=wave_task_id(members[0].task_id),
            argsrepr=repr(named),
            limits=send.ShardLimits(target, priority, hard * 0.9, hard),
        )
    send.send_shard_chord(header, job_id=str(job.id), shard_indexes=[shard.index for shard in members], queue=queue)


def wave_task_id(first_task_id: str) -> str:
    """The id of a wave's message, from its first shard's task id (new each sending, so this is too)."""
    return f"wave-{first_task_id}"


def shard_named(spec: dict[str, object]) -> tuple[dict[str, object]]:
    """The printed arguments (`argsrepr`) of a shard's message, for logs and Flower: the fields of its spec
    that name it, in the spec's form, which `tasks.shared.logging_setup.received_log_fields` reads from the worker's
    "received" line.

    Every message of a shard gives its printed arguments (its callbacks too) rather than leaving them to
    Celery, whose `saferepr` walk of the whole spec is a visible share of a short shard's control cost.
    """
    return ({field: spec[field] for field in ("job_id", "shard_index", "record_count")},)


def new_task_id(job: Job, shard: Shard, tag: str = "") -> str:
    """The id of one dispatch of a shard's task. Shards sent together share a `tag`, new for each
    sending, so that their rows take their ids in one UPDATE (`task_id_column`)."""
    return f"shard-{job.id}-{shard.index}-{tag or new_dispatch_tag()}"


def new_dispatch_tag() -> str:
    return uuid.uuid4().hex[:12]


def task_id_column(job: Job, tag: str) -> Concat:
    """`new_task_id` of each of the job's shard rows with this tag, as an SQL expression."""
    return Concat(Value(f"shard-{job.id}-"), Cast("index", CharField()), Value(f"-{tag}"), output_field=CharField())


def job_queue(job: Job) -> str:
    return gpu_queue(job.model.gpu_class.name, job.model.gpus_per_replica)


def effective_priority(job: Job) -> int:
    """0-9: a job may run below its tenant's priority (background work), never above it."""
    return priority_for(job.priority, job.tenant.priority)


def priority_for(job_priority: int | None, tenant_priority: int) -> int:
    """`effective_priority` of a job's and its tenant's priority."""
    return tenant_priority if job_priority is None else min(job_priority, tenant_priority)


def shards_revoke(job: Job) -> None:
    """Revoke the job's sent shards, so that a worker discards those still queued; the job's stop
    flag stops the running ones."""
    task_ids = list(job.shards.filter(status=ShardStatus.DISPATCHED).values_list("task_id", flat=True))
    if task_ids:
        # Revoked ids are kept by every worker and discarded on arrival; the stop flag covers a
        # worker that missed the broadcast.
        send.revoke(task_ids)
