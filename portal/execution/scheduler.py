"""The scheduler: every decision to send a shard, or to send it again, is made here.

A running job's shards wait in PostgreSQL (status `pending`), not in the broker. Each GPU queue has
a window (`portal.execution.capacity`): about two shards per live slot. Whenever places free up (a
shard ends, a job starts, the reconciler sweeps), `schedule_queue` fills them in fair-share order
(`portal.execution.fair_share`) and sends each job's claimed shards as chords (dispatch waves) of
one shard, or of a few when shards are short (`capacity.wave_size`). A chord's callback
`batchery.shard_done` settles its shards, fills their places again at once and, once none of the
job's shards is unsettled, sends the merge. A chord per job could only merge at its end; a wave of
one refills a slot's place the moment it frees, and a wave of short shards settles them for the
price of one.

So a tenant arriving behind another's large job waits for at most one shard per slot, not for the
whole backlog. Everything the scheduler decides from lives in PostgreSQL (shard rows, the usage
ledger), so after Redis is lost the reconciler's next sweep rebuilds it: shards whose messages were
lost go back to `pending` and are sent again in fair-share order.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import Count, Exists, F, Max, OuterRef
from django.utils import timezone

from gpuworkers.logs import log_context
from portal.execution.capacity import queue_slots, queue_window, wave_size
from portal.execution.costs import shard_cost_estimate
from portal.execution.decayed_usage import usage_charge, usage_read
from portal.execution.dispatch import (
    effective_priority,
    job_queue,
    new_dispatch_tag,
    new_task_id,
    shards_send,
    task_id_column,
)
from portal.execution.fair_share import TenantQueue, WaitingJob, share_out
from portal.execution.merge import job_merge, job_merge_advance
from portal.execution.settle import UNSETTLED, Settled, SettleLedger, shards_settle
from portal.execution.signals import jobs_progressed, shards_redispatched
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.jobs.selectors import queue_jobs
from portal.jobs.services.transitions import job_fail
from tasks import send
from tasks.shared.config import SHARD_MAX_DISPATCHES

logger = logging.getLogger(__name__)

SCHEDULABLE = (JobStatus.PLANNING, JobStatus.RUNNING)
"""Statuses whose pending shards are sent: a job's shards are sent while its planner still cuts more."""
SETTLING = (JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.PAUSED)
"""Statuses whose shards may still be sent or ending: a planning job's first shards run while its
planner cuts more, and a paused job's running shards finish."""


def _lock_queue(queue: str) -> None:
    """Serialize the ticks of one queue (until the transaction ends), so two never fill the same places."""
    if connection.vendor != "postgresql":
        return  # SQLite (the demo) has one writer at a time anyway.
    key = int.from_bytes(hashlib.blake2b(f"batchery:schedule:{queue}".encode(), digest_size=8).digest(), signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def schedule_queue(queue: str) -> int:
    """Fill the queue's free places with waiting shards in fair-share order; return how many were sent."""
    if _nothing_to_send():
        return 0
    claimed: list[tuple[Job, list[Shard]]] = []
    with transaction.atomic():
        _lock_queue(queue)
        jobs = queue_jobs(queue, statuses=SCHEDULABLE)
        if not jobs:
            return 0
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        longest_waiting: dict[str, float] = {}
        rows = (
            Shard.objects.filter(job__in=jobs, status__in=UNSETTLED)
            .values("job_id", "status")
            .annotate(n=Count("id"), longest=Max("estimated_seconds"))
        )
        for row in rows:
            counts[str(row["job_id"])][row["status"]] = row["n"]
            if row["status"] == ShardStatus.PENDING and row["longest"] is not None:
                longest_waiting[str(row["job_id"])] = row["longest"]
        in_flight = sum(c[ShardStatus.DISPATCHED] for c in counts.values())
        waiting = [job for job in jobs if counts[str(job.id)][ShardStatus.PENDING] > 0]
        if not waiting:
            # A job still planning has more shards coming: its running ones are not stragglers yet.
            done_planning = [job for job in jobs if job.status != JobStatus.PLANNING]
            running = sum(counts[str(job.id)][ShardStatus.DISPATCHED] for job in done_planning)
            copies = _speculate(queue, done_planning, in_flight) if settings.BATCHERY_SPECULATION and running else []
            transaction.on_commit(lambda: _send_copies(copies))
            return len(copies)
        gpu_class_id = waiting[0].model.gpu_class_id
        tenant_queues, firsts = _tenant_queues(waiting, counts, longest_waiting, gpu_class_id)
        longest = max(job.shard_cost for tenant in tenant_queues for job in tenant.jobs)
        shard_seconds = longest / waiting[0].model.gpus_per_replica
        free = queue_window(queue, shard_seconds=shard_seconds) - in_flight
        if free <= 0:
            return 0
        chosen, _ = share_out(free, tenant_queues)
        by_id = {str(job.id): job for job in waiting}
        charges: dict[int, float] = defaultdict(float)
        now = timezone.now()
        for job_id, count in chosen.items():
            job = by_id[job_id]
            if count == 1 and job_id in firsts:
                shards = [firsts[job_id]]  # read under this tick's lock: still the job's first waiting shard
            else:
                pending = Shard.objects.filter(job_id=job_id, status=ShardStatus.PENDING).order_by("index")
                shards = list(pending[:count])
            tag = new_dispatch_tag()
            for shard in shards:
                shard.status = ShardStatus.DISPATCHED
                shard.task_id = new_task_id(job, shard, tag)
                shard.attempt += 1
                shard.dispatched_at = now
                charges[job.tenant_id] += shard_cost_estimate(job, shard)
            _mark_dispatched(job, shards, now, tag)
            claimed.append((job, shards))
        usage_charge(charges=charges, gpu_class_id=gpu_class_id, now=now)
    # Rows first, one commit, then the messages: a crash in between leaves shards marked dispatched
    # with no message, which the reconciler sends again; the reverse would run shards the database
    # does not know were sent.
    wave = wave_size(queue, shard_seconds)
    for job, shards in claimed:
        shards_send(job, shards, wave=wave)
    sent = sum(len(shards) for _, shards in claimed)
    logger.info("scheduled %d shards on %s: %s", sent, queue, {str(job.id): len(s) for job, s in claimed})
    return sent


def _mark_dispatched(job: Job, shards: list[Shard], now: dt.datetime, tag: str) -> None:
    """Write the job's claimed shards' rows as their objects now say, in one UPDATE whose task ids
    SQL makes from each row's index and the tick's `tag`: `bulk_update`'s CASE for every column, and
    then a CASE of the task ids alone, cost more CPU than the rest of a tick."""
    if not shards:
        return
    Shard.objects.filter(pk__in=[shard.pk for shard in shards]).update(
        status=ShardStatus.DISPATCHED,
        dispatched_at=now,
        attempt=F("attempt") + 1,
        task_id=task_id_column(job, tag),
    )


def _nothing_to_send() -> bool:
    """No shard of any schedulable job waits or runs, so a tick would neither send nor copy one: the
    tick after the last shard of a small job settled. Read without the queue's lock; whoever makes a
    shard wait afterwards (a planner, a retry, the reconciler) schedules it in a tick of its own."""
    unsettled = Shard.objects.filter(status__in=UNSETTLED, job__status__in=SCHEDULABLE)
    return not unsettled.exists()


def _speculate(queue: str, jobs: list[Job], in_flight: int) -> list[tuple[Job, Shard]]:
    """Stragglers: with nothing left to send, each slot that would idle gets a copy of the longest
    running shard that has none yet (`speculative_task_id`); the first commit wins, and the other
    attempt stops at its next micro-batch (`tasks.slot.shard_execution`)."""
    slots = queue_slots(queue)
    running = Shard.objects.filter(job__in=jobs, status=ShardStatus.DISPATCHED)
    copied = running.exclude(speculative_task_id="").count()
    idle = slots - in_flight - copied
    if idle <= 0:
        return []
    by_id = {job.id: job for job in jobs}
    chosen = list(running.filter(speculative_task_id="").order_by("dispatched_at")[:idle])
    for shard in chosen:
        shard.speculative_task_id = f"{new_task_id(by_id[shard.job_id], shard)}-copy"
    Shard.objects.bulk_update(chosen, ["speculative_task_id"])
    return [(by_id[shard.job_id], shard) for shard in chosen]


def _send_copies(copies: list[tuple[Job, Shard]]) -> None:
    for job, shard in copies:
        logger.info("job %s: shard %d straggles; a copy runs beside it", job.id, shard.index)
        shards_send(job, [shard], copies=True)


def _tenant_queues(
    jobs: list[Job], counts: dict[str, Counter[str]], longest_waiting: dict[str, float], gpu_class_id: int
) -> tuple[list[TenantQueue], dict[str, Shard]]:
    """The waiting jobs by tenant, for `share_out`; and each job's first waiting shard, which a tick that
    sends it one shard sends without reading again.

    A job's shard cost is its longest waiting shard's estimate (its first waiting one's where none has
    an estimate). Its first shards are cut short, for a fast first result: sized by the first waiting
    one, the window of a job that had just started held many times the work it means to (24 shards of
    a second for 4 slots in the fairness bench), and a tenant arriving next waited behind all of it."""
    usage = usage_read(tenant_ids={job.tenant_id for job in jobs}, gpu_class_id=gpu_class_id)
    tenants: dict[int, TenantQueue] = {}
    firsts: dict[str, Shard] = {}
    for job in jobs:
        tenant = tenants.setdefault(
            job.tenant_id, TenantQueue(tenant_id=job.tenant_id, weight=job.tenant.weight, usage=usage[job.tenant_id])
        )
        pending = counts[str(job.id)][ShardStatus.PENDING]
        sample = Shard.objects.filter(job=job, status=ShardStatus.PENDING).order_by("index").first()
        if sample is not None:
            firsts[str(job.id)] = sample
        tenant.jobs.append(
            WaitingJob(
                job_id=str(job.id),
                priority=effective_priority(job),
                created_at=job.created_at.timestamp(),
                pending=pending,
                shard_cost=max(
                    shard_cost_estimate(job, sample) if sample else 0.0,
                    longest_waiting.get(str(job.id), 0.0) * job.model.gpus_per_replica,
                ),
            )
        )
    return list(tenants.values()), firsts


def schedule_job(*, job_id: str) -> None:
    """A job's shards wait (its planner wrote some, it was planned or retried): send what its queue has
    room for; a job without shards merges."""
    job = Job.objects.select_related("model__gpu_class", "tenant").get(pk=job_id)
    if job.status not in SCHEDULABLE:
        logger.info("job %s is %s; not scheduling", job_id, job.status)
        return
    if not job.shards.exists():
        _send_merge(job_id)
        return
    schedule_queue(job_queue(job))


def schedule_all() -> int:
    """Fill every queue that has running jobs (the reconciler's sweep: after Redis was lost, say).

    Each queue on its own: one whose tick fails (a broker unreachable for its class's messages, a
    job whose shards cannot be sent) is logged and tried at the next sweep, the others are filled now."""
    queues = {job_queue(job) for job in Job.objects.select_related("model__gpu_class").filter(status__in=SCHEDULABLE)}
    sent = 0
    for queue in sorted(queues):
        try:
            sent += schedule_queue(queue)
        except Exception:
            logger.exception("scheduling %s failed; the next sweep tries again", queue)
    return sent


def shards_requeue(*, job: Job, shards: Sequence[Shard], reason: str) -> int:
    """Put shards whose message was lost or whose task was killed back to pending; return how many.

    Each goes back only if it still carries the task id it was last sent with, so two reconcilers
    cannot both send it. A shard sent too often fails for good instead. The caller schedules.
    """
    requeued: list[Shard] = []
    for shard in shards:
        if shard.attempt >= SHARD_MAX_DISPATCHES:
            Shard.objects.filter(pk=shard.pk, task_id=shard.task_id).update(
                status=ShardStatus.FAILED,
                error=f"sent {shard.attempt} times and never finished ({reason})",
                error_codes={"shard_failed": shard.record_count},
            )
            continue
        if Shard.objects.filter(pk=shard.pk, status=ShardStatus.DISPATCHED, task_id=shard.task_id).update(
            status=ShardStatus.PENDING
        ):
            requeued.append(shard)
    if requeued:
        logger.warning("job %s: %d shards to send again: %s", job.id, len(requeued), reason)
        shards_redispatched.send(sender=Job, job=job, count=len(requeued))
        _refund(job, requeued)
    return len(requeued)


def shard_finished(*, job_id: str, shard_index: int) -> None:
    """A shard's task returned or failed (its chord callback): settle it, refill its place, stitch
    what has finished, merge when all settled."""
    shards_finished([(job_id, shard_index)])


class Ending(NamedTuple):
    """A shard whose task returned or failed, as its chord's callback reports it."""

    job_id: str
    shard_index: int
    in_wave: bool = False
    """Its message was a wave's (`run_shards`), which has ended: see `settle.shard_settle`'s `wave_ended`."""


def shards_finished(endings: Iterable[Ending | tuple[str, int]]) -> None:
    """Shards whose tasks returned or failed, settled together (`finished_inbox` gathers them): a job's
    committed shards' rows are written in one statement, the usage ledger and the throughput fit once,
    each queue is scheduled once and each job is looked at for its merge once, however many shards ended.

    A job whose shard output contradicts its row fails; a database error goes up (the caller gives
    the endings back and the task retries); any other error leaves that job's shards to the
    reconciler's sweep and the other jobs are settled now."""
    by_job: defaultdict[str, dict[int, bool]] = defaultdict(dict)
    for job_id, index, in_wave in (Ending(*ending) for ending in endings):
        by_job[str(job_id)][int(index)] = in_wave
    rows = Job.objects.select_related("model__gpu_class", "tenant").filter(pk__in=list(by_job))
    jobs = {str(job.pk): job for job in rows}
    ledger = SettleLedger()
    settled_jobs: list[Job] = []
    for job_id, indexes in by_job.items():
        job = jobs.get(job_id)
        if job is None:
            continue  # deleted since: nothing to settle
        try:
            _settle_shards(job, indexes, ledger)
        except (OperationalError, InterfaceError):
            raise
        except ValueError as exc:
            job_fail(job_id=job_id, reason=f"refused inconsistent shard output: {exc}")
            continue
        except Exception:
            logger.exception("job %s: settling shards %s failed; the reconciler tries again", job_id, sorted(indexes))
            continue
        settled_jobs.append(job)
    ledger.flush()
    for queue in sorted({job_queue(job) for job in jobs.values()}):
        schedule_queue(queue)
    running: list[Job] = []
    for job in settled_jobs:
        if not merge_when_settled(job, small_here=True):
            # Stitch what has finished now, so the merge at the end has only the tail left.
            job_merge_advance(job_id=str(job.id), holder="settle")
            running.append(job)
    # A job that merges now tells its end instead (`job_ended`): a one-record job's ending asked for
    # its tenant's endpoints twice.
    jobs_progressed.send(sender=Job, jobs=running)


def _settle_shards(job: Job, indexes: dict[int, bool], ledger: SettleLedger) -> None:
    """Settle the job's shards of these indexes (-> whether they ended in a wave)."""
    unsettled = Shard.objects.filter(job=job, index__in=list(indexes), status__in=UNSETTLED).order_by("index")
    in_wave = {index for index, ended_in_wave in indexes.items() if ended_in_wave}
    for shard, settled in shards_settle(job, list(unsettled), ledger, ended_in_wave=in_wave):
        if settled is Settled.RETRY:
            shards_requeue(job=job, shards=[shard], reason="its task was killed or its worker lost")
        elif settled is Settled.HELD:
            shard_hold_back(shard)


def shard_hold_back(shard: Shard) -> None:
    """A shard that arrived while its job was paused waits again; that dispatch does not count."""
    if Shard.objects.filter(pk=shard.pk, status=ShardStatus.DISPATCHED, task_id=shard.task_id).update(
        status=ShardStatus.PENDING, attempt=F("attempt") - 1
    ):
        _refund(Job.objects.select_related("model").get(pk=shard.job_id), [shard])


def _refund(job: Job, shards: Sequence[Shard]) -> None:
    """Take back the estimate charged when the shards were sent: they go back unrun, and are charged
    again when sent again. Without this, a tenant whose messages were lost would pay for them twice."""
    estimate = sum(shard_cost_estimate(job, shard) for shard in shards)
    usage_charge(charges={job.tenant_id: -estimate}, gpu_class_id=job.model.gpu_class_id)


def merge_when_settled(job: Job, *, small_here: bool = False) -> bool:
    """Send the merge of a running job none of whose shards of the current round is unsettled; with
    `small_here`, a job of at most `BATCHERY_INLINE_MERGE_MAX_RECORDS` records merges in this call.

    The status is read afresh: a shard's callback holds its job as read before it settled the shard,
    and the job may have ended planning since (a `planning` job never merges: its last shard is not
    cut yet), so that whichever of the two comes second sends the merge."""
    unsettled = Shard.objects.filter(job=OuterRef("pk"), round=job.retry_round, status__in=UNSETTLED)
    fresh = (
        Job.objects.filter(pk=job.pk, status=JobStatus.RUNNING)
        .values("total_records", unsettled=Exists(unsettled))
        .first()
    )
    if fresh is None or fresh["unsettled"]:
        return False
    records = fresh["total_records"]
    if small_here and records is not None and records <= settings.BATCHERY_INLINE_MERGE_MAX_RECORDS:
        _merge_here(str(job.id))
    else:
        _send_merge(str(job.id))
    return True


def _merge_here(job_id: str) -> None:
    """Merge a small job in the settling callback: the merge task's hop through the broker is most of
    a one-record job's tail. Whatever stops it here, the merge task takes over and resumes it.

    Its lines carry the job's id as the merge task's do: the callback itself may settle several jobs."""
    try:
        with log_context(job_id=job_id):
            job_merge(job_id=job_id, holder=f"settle:{os.getpid()}")
    except Exception:
        logger.warning(
            "job %s: merging in the settling callback failed; the merge task takes over", job_id, exc_info=True
        )
        _send_merge(job_id)


def _send_merge(job_id: str) -> None:
    send.send_merge(job_id)
