"""Every message the portal and the control side send, built by task name through the one app.

Senders never import a task module: a portal process would load the slot's runtime and its signal
handlers with it, and the services that send would import the tasks that call them. The names and
their queues are the configuration's (`tasks.shared.config`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from celery import chord, group
from celery.canvas import Signature

from tasks.app import app
from tasks.shared.config import (
    COMPARE_TASK,
    CONTROL_QUEUE,
    DELIVER_WEBHOOK_TASK,
    FINALIZE_BATCH_TASK,
    MERGE_TASK,
    PLAN_TASK,
    PLANNING_QUEUE,
    SHARD_TASK,
    SHARDS_ENDED_TASK,
    VALIDATE_BATCH_TASK,
    VALIDATION_QUEUE,
    WAVE_TASK,
    WEBHOOKS_QUEUE,
)


class ShardLimits(NamedTuple):
    """Where a shard message goes and how long it may run (its Celery options)."""

    queue: str
    priority: int
    soft_time_limit: float
    time_limit: float


def send_plan(job_id: str, *, task_id: str | None = None) -> None:
    app.send_task(PLAN_TASK, (job_id,), task_id=task_id, queue=PLANNING_QUEUE)


def send_comparison(job_id: str) -> None:
    """Write the comparison report of a re-run that has ended (on the planning lane: it reads two outputs)."""
    app.send_task(COMPARE_TASK, (job_id,), queue=PLANNING_QUEUE)


def send_merge(job_id: str, *, stop: str | None = None, task_id: str | None = None) -> None:
    """Merge a job whose shards have settled, or finalize a stopped one (`stop`: `cancelled`, `expired`)."""
    kwargs = {"stop": stop} if stop else {}
    app.send_task(MERGE_TASK, (job_id,), kwargs, task_id=task_id, queue=CONTROL_QUEUE)


def send_batch_validation(batch_id: str, *, task_id: str) -> None:
    app.send_task(VALIDATE_BATCH_TASK, (batch_id,), task_id=task_id, queue=VALIDATION_QUEUE)


def send_batch_finalize(batch_id: str) -> None:
    app.send_task(FINALIZE_BATCH_TASK, (batch_id,), queue=CONTROL_QUEUE)


def send_webhook_delivery(delivery_id: int, *, countdown: float | None = None) -> None:
    app.send_task(DELIVER_WEBHOOK_TASK, (delivery_id,), countdown=countdown, queue=WEBHOOKS_QUEUE)


def shard_signature(spec: dict[str, Any], *, task_id: str, argsrepr: str, limits: ShardLimits) -> Signature:
    """One shard's message (`run_shard`)."""
    return app.signature(SHARD_TASK, (spec,), task_id=task_id, argsrepr=argsrepr, kwargsrepr="{}", **limits._asdict())


def wave_signature(shards: Sequence[list[Any]], *, task_id: str, argsrepr: str, limits: ShardLimits) -> Signature:
    """A wave of short shards in one message (`run_shards`): `[task id, spec, soft time limit]` each."""
    return app.signature(
        WAVE_TASK, (list(shards),), task_id=task_id, argsrepr=argsrepr, kwargsrepr="{}", **limits._asdict()
    )


def send_shard_chord(header: Signature, *, job_id: str, shard_indexes: list[int], queue: str) -> None:
    """Send a shard message (or a wave) as a chord of one, whose callback and error callback both report
    the shards' endings (`shard_done`) on the control queue."""
    done = (job_id, shard_indexes, queue)
    callback = app.signature(
        SHARDS_ENDED_TASK, done, immutable=True, queue=CONTROL_QUEUE, argsrepr=repr(done), kwargsrepr="{}"
    )
    callback.on_error(callback.clone())
    chord(group([header]), callback).apply_async()


def revoke(task_ids: list[str]) -> None:
    """Every worker discards these messages on arrival (a broadcast; running ones are stopped by their flag)."""
    app.control.revoke(task_ids)
