"""Settling a shard whose task ended: what its commit marker and its task's result say, on its row.

Called for each shard by its chord callback (`batchery.shard_done`), and by the reconciler's sweep
for shards whose callback was lost. Deciding to send a shard again is the scheduler's; settling only
says that it should (`Settled.RETRY`).
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import logging
from collections import defaultdict
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from celery import states
from django.db import DatabaseError, InterfaceError, OperationalError, connection

from portal.catalog.throughput import throughput_observe_many
from portal.execution.costs import shard_cost_estimate, shard_cost_measured
from portal.execution.decayed_usage import usage_charge
from portal.jobs.models import UNSETTLED, Job, Shard, ShardStatus
from tasks.app import app
from tasks.shared.specs import ShardManifest, attempt_started, read_commit
from tasks.shared.stops import PAUSED

logger = logging.getLogger(__name__)

# Failures a new attempt may not repeat: the task was killed or its process died.
TRANSIENT_FAILURES = frozenset({"TimeLimitExceeded", "SoftTimeLimitExceeded", "WorkerLostError", "Terminated"})


class Settled(enum.Enum):
    COMMITTED = "committed"
    RUNNING = "running"
    """No commit and no failure: the task runs, waits in the broker, or was lost (the reconciler judges)."""
    RETRY = "retry"
    """The task was killed or its worker lost: the shard may be sent again."""
    HELD = "held"
    """The task found its job paused and returned unrun, or its wave ended before it ran: the shard
    waits to be sent again, at no cost."""
    FAILED = "failed"


@dataclass(frozen=True)
class TaskFailure:
    reason: str
    transient: bool


@dataclass
class SettleLedger:
    """What settled shards add to the fair-share ledger and the throughput fit, written once for
    many shards (`flush`): a batch of endings costs a few statements, not a few per shard."""

    charges: defaultdict[int, defaultdict[int, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    """GPU class -> tenant -> GPU-seconds (a correction: measured less estimated)."""
    observations: defaultdict[tuple[int, int], list[tuple[int, int, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    """(model, GPU class) -> (records, chars, seconds) of each committed shard, in settling order."""

    def flush(self) -> None:
        for gpu_class_id, charges in self.charges.items():
            usage_charge(charges=charges, gpu_class_id=gpu_class_id)
        for (model_id, gpu_class_id), shards in self.observations.items():
            throughput_observe_many(model_id=model_id, gpu_class_id=gpu_class_id, shards=shards)
        self.charges.clear()
        self.observations.clear()


def _task_outcome(shard: Shard) -> tuple[str, Any]:
    """The state and result the shard's current task stored, read once; PENDING if none yet."""
    if not shard.task_id:
        return states.PENDING, None
    meta = app.backend.get_task_meta(shard.task_id)
    return meta["status"], meta["result"]


def _failure(value: object) -> TaskFailure:
    name = type(value).__name__ if isinstance(value, BaseException) else "Error"
    reason = f"{name}: {value}" if isinstance(value, BaseException) else str(value)
    return TaskFailure(reason=reason, transient=name in TRANSIENT_FAILURES)


def read_manifest(shard: Shard) -> ShardManifest | None:
    """The shard's committed manifest; ValueError when it does not account for the shard's records."""
    manifest = read_commit(shard.prefix_uri)
    if manifest is not None and manifest.records != shard.record_count:
        raise ValueError(f"shard {shard.index} committed {manifest.records} records but holds {shard.record_count}")
    return manifest


def shard_provenance_row(provenance: dict[str, Any]) -> dict[str, Any]:
    """What a shard's row keeps of its commit's provenance: all of it but the model's file list, which the
    job's manifest reads once a weights digest from one commit marker (`job_manifest`)."""
    if not provenance:
        return {}
    model = {key: value for key, value in provenance.get("model", {}).items() if key != "files"}
    return {**provenance, "model": model}


def _success_values(manifest: ShardManifest) -> dict[str, Any]:
    """What a committed attempt writes on its shard's row."""
    return {
        "status": ShardStatus.SUCCEEDED,
        "attempt_id": manifest.attempt_id,
        "output_uri": manifest.output_uri,
        "errors_uri": manifest.errors_uri,
        "succeeded_records": manifest.succeeded,
        "failed_records": manifest.failed,
        "prompt_tokens": manifest.prompt_tokens,
        "completion_tokens": manifest.completion_tokens,
        "cached_prompt_tokens": manifest.cached_prompt_tokens,
        "worker": manifest.worker,
        "worker_pid": manifest.pid,
        "cache_hit": manifest.cache_hit,
        "started_at": dt.datetime.fromtimestamp(manifest.started_at, tz=dt.UTC),
        "finished_at": dt.datetime.fromtimestamp(manifest.finished_at, tz=dt.UTC),
        "compute_seconds": manifest.compute_seconds,
        "load_seconds": manifest.load_seconds,
        "error_codes": manifest.error_codes,
        "adapter_usage": manifest.adapter_usage,
        "provenance": shard_provenance_row(manifest.provenance),
    }


def shard_record_success(shard: Shard, manifest: ShardManifest) -> bool:
    """Record the committed attempt on the shard's row; True if this call settled it."""
    if shard.status == ShardStatus.SUCCEEDED and shard.attempt_id == manifest.attempt_id:
        return False  # the row as read records this attempt already (a merge after the shard's settling)
    return bool(
        Shard.objects.filter(pk=shard.pk)
        .exclude(status=ShardStatus.SUCCEEDED, attempt_id=manifest.attempt_id)
        .update(**_success_values(manifest))
    )


def shards_record_success(committed: Sequence[tuple[Shard, ShardManifest]]) -> list[tuple[Shard, ShardManifest]]:
    """`shard_record_success` of many shards; return those this call settled.

    On PostgreSQL one UPDATE writes them all and says which rows it changed: one ORM UPDATE a shard
    spent more of the control worker's time compiling its SQL than settling anything else."""
    if connection.vendor != "postgresql" or len(committed) < 2:
        return [(shard, manifest) for shard, manifest in committed if shard_record_success(shard, manifest)]
    quote = connection.ops.quote_name
    fields = {field.name: field for field in Shard._meta.concrete_fields}
    column = {name: quote(str(field.column)) for name, field in fields.items()}
    written = list(_success_values(committed[0][1]))
    # Each value cast to its column's type: the VALUES list's literals are untyped.
    value = {name: f"CAST(v.{column[name]} AS {fields[name].db_type(connection)})" for name in ("id", *written)}
    row = "(" + ", ".join(["%s"] * len(value)) + ")"
    sql = (
        f"UPDATE {quote(Shard._meta.db_table)} AS s"
        f" SET {', '.join(f'{column[name]} = {value[name]}' for name in written)}"
        f" FROM (VALUES {', '.join([row] * len(committed))}) AS v({', '.join(column[name] for name in value)})"
        f" WHERE s.{column['id']} = {value['id']}"
        f" AND (s.{column['status']} <> %s OR s.{column['attempt_id']} <> {value['attempt_id']})"
        f" RETURNING s.{column['id']}"
    )
    params: list[Any] = []
    for shard, manifest in committed:
        values = _success_values(manifest)
        values["error_codes"] = json.dumps(values["error_codes"])
        values["adapter_usage"] = json.dumps(values["adapter_usage"])
        values["provenance"] = json.dumps(values["provenance"])
        params += [shard.pk, *values.values()]
    params.append(ShardStatus.SUCCEEDED)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        settled = {row_id for (row_id,) in cursor.fetchall()}
    return [(shard, manifest) for shard, manifest in committed if shard.pk in settled]


def shard_record_failure(shard: Shard, *, reason: str, code: str = "shard_failed", settling: bool = False) -> bool:
    """The shard ends without a commit: each of its records becomes an error line coded `code`; True if
    this call wrote it.

    `settling`: its task's failure, read while the shard was unsettled under that task's id, is written
    only if it still is. Another control process may have settled it meanwhile (a copy of the shard
    committed) or sent it again: a success or a new attempt is never overwritten by a stale failure.
    The merge writes its outcomes unconditionally: they are what the output it publishes holds."""
    rows = Shard.objects.filter(pk=shard.pk)
    if settling:
        rows = rows.filter(status__in=UNSETTLED, task_id=shard.task_id)
    return bool(rows.update(status=ShardStatus.FAILED, error=reason, error_codes={code: shard.record_count}))


@dataclass
class SettleBatch:
    """Shards of several jobs settled together: each job's shards examined on its own (`examine`), the
    rows of all those committed written in one statement (`write`), their usage corrections and
    throughput put in `ledger` (the caller flushes it): a batch of endings, or a sweep, of many jobs costs
    two statements, not two a job."""

    ledger: SettleLedger
    committed: list[tuple[Job, Shard, ShardManifest]] = field(default_factory=list)

    def examine(
        self, job: Job, shards: Sequence[Shard], *, ended_in_wave: Set[int] = frozenset()
    ) -> list[tuple[Shard, Settled]]:
        """What is to be done with each of the job's unsettled shards: a committed one is kept for
        `write`; an uncommitted one's failure is recorded now. For the indexes in `ended_in_wave`, the wave
        message that carried the shard (`run_shards`) has ended, so a shard with no outcome of its own never
        ran to its end: the wave's time limit or a lost worker ended it there (RETRY), or it waited behind
        the shard that did (HELD: that sending does not count). ValueError: a commit that contradicts its
        row (nothing of the job is kept then)."""
        outcomes: list[tuple[Shard, Settled]] = []
        committed: list[tuple[Job, Shard, ShardManifest]] = []
        for shard in shards:
            manifest = read_manifest(shard)
            if manifest is None:
                outcomes.append((shard, _settle_uncommitted(shard, wave_ended=shard.index in ended_in_wave)))
            else:
                committed.append((job, shard, manifest))
                outcomes.append((shard, Settled.COMMITTED))
        self.committed += committed
        return outcomes

    def write(self) -> None:
        """Record the committed attempts. A database error that is not the database being away (a value
        one shard's manifest carries, say) fails each job's rows alone, logged and left to the
        reconciler's sweep: one bad shard must not keep its queue's other endings from settling."""
        try:
            settled = shards_record_success([(shard, manifest) for _, shard, manifest in self.committed])
        except (OperationalError, InterfaceError):
            raise
        except DatabaseError:
            logger.warning("writing %d settled shards together failed; each job's alone", len(self.committed))
            settled = self._write_each_job()
        jobs = {shard.pk: job for job, shard, _ in self.committed}
        for shard, manifest in settled:
            self._account(jobs[shard.pk], shard, manifest)
        self.committed = []

    def _write_each_job(self) -> list[tuple[Shard, ShardManifest]]:
        by_job: defaultdict[str, list[tuple[Shard, ShardManifest]]] = defaultdict(list)
        for job, shard, manifest in self.committed:
            by_job[str(job.pk)].append((shard, manifest))
        settled: list[tuple[Shard, ShardManifest]] = []
        for job_id, committed in by_job.items():
            try:
                settled += shards_record_success(committed)
            except (OperationalError, InterfaceError):
                raise
            except DatabaseError:
                logger.exception("job %s: recording its committed shards failed; the reconciler tries again", job_id)
        return settled

    def _account(self, job: Job, shard: Shard, manifest: ShardManifest) -> None:
        gpu_class_id = job.model.gpu_class_id
        correction = shard_cost_measured(job, manifest) - shard_cost_estimate(job, shard)
        self.ledger.charges[gpu_class_id][job.tenant_id] += correction
        self.ledger.observations[(job.model_id, gpu_class_id)].append(
            (manifest.records, shard.input_chars, manifest.compute_seconds)
        )


def _settle_uncommitted(shard: Shard, *, wave_ended: bool) -> Settled:
    state, value = _task_outcome(shard)
    if state == states.FAILURE:
        failure = _failure(value)
        if failure.transient:
            return Settled.RETRY
        if shard_record_failure(shard, reason=failure.reason, settling=True):
            return Settled.FAILED
        return Settled.RUNNING  # settled by someone else meanwhile: nothing left to do here
    if state == states.SUCCESS and isinstance(value, dict) and value.get("skipped") == PAUSED:
        return Settled.HELD
    if state == states.PENDING and wave_ended:
        return Settled.RETRY if attempt_started(shard.prefix_uri) else Settled.HELD
    return Settled.RUNNING
