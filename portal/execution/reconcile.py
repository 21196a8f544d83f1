"""Reconcile: the jobs' part of the periodic sweep (`portal.ops.periodic`), which makes every job reach an
ending whatever was lost.

Redis holds messages, results and leases only; the database and storage hold the truth. Each
sweep, on the control queue:
- sends planning again for jobs left `queued` or `planning` by a crash or a lost message;
- settles shards whose chord callback never came, and gives the scheduler back those that are
  neither committed, nor held by a live attempt (lease), nor waiting in the broker where a slot will
  take them (their message was lost, e.g. Redis restarted empty, or waits on the own queue of a slot
  that died or was drained); then lets the scheduler fill every queue. Only shards with
  no live lease, sent longer ago than `SETTLE_GRACE_S`, are looked at in storage (one MGET of the
  job's leases finds them), and the broker's queues are read only if one of them needs it: a sweep
  costs what went wrong, not how much runs;
- merges running jobs whose shards are all settled but whose merge never came, and resumes merges
  and cancellations whose worker died;
- empties the own queues of slots gone, once their routed shards were sent again (`own_queues.py`).
Everything it sends is idempotent on the receiving side, so a sweep that races a late message is
harmless. Each job is swept on its own: one whose storage says something impossible fails alone.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from django.conf import settings
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from portal.execution.adapter_routes import slot_takes
from portal.execution.dispatch import job_queue
from portal.execution.endings import shard_hold_back, shards_requeue
from portal.execution.own_queues import own_queues_retire
from portal.execution.scheduler import schedule_all
from portal.execution.settle import SettleBatch, Settled, SettleLedger
from portal.jobs.models import SETTLING, Job, JobStatus, Shard, ShardStatus
from portal.jobs.transitions import job_fail
from tasks import send
from tasks.shared.broker_probe import BrokerView, pending_task_ids
from tasks.shared.config import CONTROL_QUEUE, PLANNING_QUEUE, VISIBILITY_TIMEOUT_S
from tasks.shared.leases import job_lease_key, lease_holder, lease_holders, shard_lease_key
from tasks.shared.stops import request_pause

logger = logging.getLogger(__name__)

# A step untouched for this long, with no lease and no message, is presumed lost.
STALE_AFTER_S = settings.BATCHERY_RECONCILE_STALE_AFTER_S
# `_lost` judges no shard younger than this lost, so the sweep leaves such shards to their callbacks.
SETTLE_GRACE_S = min(STALE_AFTER_S / 4, VISIBILITY_TIMEOUT_S)

PendingView = Callable[[], BrokerView | None]


@dataclass
class ReconcileReport:
    planned: int = 0
    resent_shards: int = 0
    scheduled_shards: int = 0
    merged: int = 0
    failed_jobs: int = 0
    finalized: int = 0
    emptied_own_queues: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _plan_task_id(job_id: str) -> str:
    return f"plan-{job_id}"


def _merge_task_id(job_id: str) -> str:
    return f"merge-{job_id}"


def _stale(job: Job, now: dt.datetime) -> bool:
    return (now - job.updated_at).total_seconds() > STALE_AFTER_S


def _replan_stalled(now: dt.datetime, pending: PendingView, report: ReconcileReport) -> None:
    for job in Job.objects.filter(status__in=[JobStatus.QUEUED, JobStatus.PLANNING]):
        if not _stale(job, now) or lease_holder(job_lease_key("plan", str(job.id))) is not None:
            continue
        view = pending()
        if view is not None and _plan_task_id(str(job.id)) in view:
            continue
        logger.warning("job %s stalled in %s; sending planning again", job.id, job.status)
        send.send_plan(str(job.id), task_id=_plan_task_id(str(job.id)))
        report.planned += 1


def _lost(shard: Shard, pending: PendingView, now: dt.datetime, queue: str) -> bool:
    """No live attempt holds the shard and its message is gone, or is stuck with a worker that
    stopped renewing its lease (dead or paused) for longer than the visibility timeout, or waits on
    the own queue of a slot that no longer takes it (dead or drained; `adapter_routes`)."""
    if lease_holder(shard_lease_key(str(shard.job_id), shard.index)) is not None:
        return False
    age = (now - shard.dispatched_at).total_seconds() if shard.dispatched_at else float("inf")
    view = pending()
    if view is None or shard.task_id in view.unacked:
        # The broker gives such a message back only after the visibility timeout (and kombu checks
        # rarely); sending it again sooner could run a shard twice while its worker still lives.
        return age > VISIBILITY_TIMEOUT_S
    if age <= STALE_AFTER_S / 4:
        return False  # a message sent a moment ago may not be visible yet
    return shard.task_id not in view.queued or bool(shard.slot_queue and not slot_takes(shard.slot_queue, queue))


def _unattended(jobs: list[Job], now: dt.datetime) -> dict[str, list[Shard]]:
    """The jobs' dispatched shards that may have ended or been lost unseen, by job id: sent before the
    grace, held by no live attempt. A held or fresh shard's own callback settles it.

    Two statements and one MGET for all the jobs: a few a job made a sweep over 2,000 running jobs
    take seconds of round trips, almost all finding nothing."""
    sent_before = now - dt.timedelta(seconds=SETTLE_GRACE_S)
    # Keys only: a sweep reads every running shard's, and whole rows cost several times as much to read.
    sent = list(
        Shard.objects.filter(job__in=jobs, status=ShardStatus.DISPATCHED)
        .filter(Q(dispatched_at__lte=sent_before) | Q(dispatched_at__isnull=True))
        .values_list("pk", "job_id", "index")
    )
    holders = lease_holders([shard_lease_key(str(job_id), index) for _, job_id, index in sent])
    free = [pk for (pk, _, _), holder in zip(sent, holders, strict=True) if holder is None]
    by_job: dict[str, list[Shard]] = {}
    for shard in Shard.objects.filter(pk__in=free).order_by("index") if free else []:
        by_job.setdefault(str(shard.job_id), []).append(shard)
    return by_job


def _sweep_job(
    job: Job,
    outcomes: list[tuple[Shard, Settled]],
    settled_round: bool,
    now: dt.datetime,
    pending: PendingView,
    report: ReconcileReport,
) -> None:
    """Send again the job's unattended shards that settling found lost (`outcomes`); merge it if none of
    its round is unsettled. `settled_round`: none was when the sweep began (read for all jobs at once;
    read again here for a job whose shards the sweep settled)."""
    lost = []
    for shard, settled in outcomes:
        if settled is Settled.HELD:
            shard_hold_back(shard)
        elif settled is Settled.RETRY or (settled is Settled.RUNNING and _lost(shard, pending, now, job_queue(job))):
            lost.append(shard)
    if lost:
        report.resent_shards += shards_requeue(
            job=job, shards=lost, reason="no live attempt and no message in the broker"
        )
    if job.status != JobStatus.RUNNING:
        return  # a paused job merges once resumed, a planning one once its planner has cut every shard
    if outcomes:
        settled_round = not _round_unsettled(job).exists()
    if settled_round and lease_holder(job_lease_key("merge", str(job.id))) is None:
        # The last shard's callback may be on its way; a second merge of the same job does nothing.
        send.send_merge(str(job.id), task_id=_merge_task_id(str(job.id)))
        report.merged += 1


@contextmanager
def _alone(job: Job, report: ReconcileReport) -> Iterator[None]:
    """Each job is swept on its own: one whose storage says something impossible fails alone, and one
    whose sweep fails otherwise (storage unreachable for its prefix, say) is tried again at the next sweep."""
    try:
        yield
    except ValueError as exc:
        job_fail(job_id=str(job.id), reason=f"reconcile refused inconsistent shard output: {exc}")
        report.failed_jobs += 1
    except Exception:
        logger.exception("reconcile: sweeping job %s failed; the next sweep tries again", job.id)


def _round_unsettled(job: Job) -> QuerySet[Shard]:
    return job.shards.filter(round=job.retry_round, status__in=[ShardStatus.PENDING, ShardStatus.DISPATCHED])


def _settled_rounds(jobs: list[Job]) -> set[str]:
    """The running jobs none of whose shards of their current round is unsettled, in one statement."""
    unsettled = Shard.objects.filter(
        job=OuterRef("pk"), round=OuterRef("retry_round"), status__in=[ShardStatus.PENDING, ShardStatus.DISPATCHED]
    )
    running = [job.pk for job in jobs if job.status == JobStatus.RUNNING]
    settled = Job.objects.filter(pk__in=running).exclude(Exists(unsettled)).values_list("pk", flat=True)
    return {str(pk) for pk in settled}


def _sweep_running(now: dt.datetime, pending: PendingView, report: ReconcileReport) -> None:
    jobs = list(Job.objects.select_related("model__gpu_class", "tenant").filter(status__in=SETTLING))
    # Rebuilt from PostgreSQL on every sweep: a pause outlives Redis.
    request_pause([str(job.id) for job in jobs if job.status == JobStatus.PAUSED])
    unattended = _unattended(jobs, now)
    settled_rounds = _settled_rounds(jobs)
    # Every job's unattended shards examined alone, those committed written together: after Redis came
    # back empty, every running shard is unattended.
    batch = SettleBatch(SettleLedger())
    examined: dict[str, list[tuple[Shard, Settled]]] = {}
    for job in jobs:
        if shards := unattended.get(str(job.id)):
            with _alone(job, report):
                examined[str(job.id)] = batch.examine(job, shards)
    batch.write()
    batch.ledger.flush()
    for job in jobs:
        job_id = str(job.id)
        if job_id in unattended and job_id not in examined:
            continue  # failed above
        with _alone(job, report):
            _sweep_job(job, examined.get(job_id, []), job_id in settled_rounds, now, pending, report)
    report.scheduled_shards += schedule_all()


def _resume_stalled_endings(now: dt.datetime, report: ReconcileReport) -> None:
    stalled = Job.objects.filter(Q(status=JobStatus.MERGING) | Q(status=JobStatus.CANCELLING))
    for job in stalled:
        if not _stale(job, now) or lease_holder(job_lease_key("merge", str(job.id))) is not None:
            continue
        stop = "cancelled" if job.status == JobStatus.CANCELLING else None
        if job.status == JobStatus.MERGING and job.deadline_at is not None and job.deadline_at <= now:
            stop = "expired"
        send.send_merge(str(job.id), stop=stop)
        report.finalized += 1


def _pending_view() -> PendingView:
    """The broker's messages, read at most once a sweep and only when asked: reading means
    reading the queues whole, which a sweep where every shard is held or fresh does not need."""

    @functools.cache
    def read() -> BrokerView | None:
        running = Job.objects.select_related("model__gpu_class").filter(status__in=SETTLING)
        routed = Shard.objects.filter(status=ShardStatus.DISPATCHED).exclude(slot_queue="").values_list("slot_queue")
        slot_queues = {slot_queue for (slot_queue,) in routed.distinct()}
        return pending_task_ids({CONTROL_QUEUE, PLANNING_QUEUE, *slot_queues, *(job_queue(job) for job in running)})

    return read


def jobs_reconcile() -> ReconcileReport:
    now = timezone.now()
    report = ReconcileReport()
    pending = _pending_view()
    _replan_stalled(now, pending, report)
    _sweep_running(now, pending, report)
    _resume_stalled_endings(now, report)
    report.emptied_own_queues = own_queues_retire()
    if any(asdict(report).values()):
        logger.warning("reconcile: %s", report)
    return report
