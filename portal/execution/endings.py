"""Settling endings: the shards whose tasks returned or failed, as their chords' callbacks report them
(gathered by `endings_inbox`), settled together; a shard to be sent again goes back to `pending` for the
scheduler, and a job none of whose shards is unsettled merges (a small one here, in the callback).
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import redis
from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.db.models import Exists, F, OuterRef, Q

from gpuworkers.logs import log_context
from portal.execution.budget_stop import jobs_within_budget
from portal.execution.costs import shard_cost_estimate
from portal.execution.decayed_usage import usage_charge
from portal.execution.dispatch import job_queue
from portal.execution.merge import job_merge, job_merge_advance
from portal.execution.scheduler import schedule_queue
from portal.execution.settle import SettleBatch, Settled, SettleLedger
from portal.execution.signals import jobs_progressed, shards_redispatched
from portal.jobs.models import UNSETTLED, Job, JobStatus, Shard, ShardStatus
from portal.jobs.transitions import job_fail
from tasks import send
from tasks.shared.config import SHARD_MAX_DISPATCHES
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

ADVANCE_INTERVAL_S = 5
"""Seconds between two stitches ahead of one job's finished shards by settling (`_advance_due`)."""
ADVANCE_KEY = "batchery:merge-advance-due:{job_id}"


class ShardEnding(NamedTuple):
    """A shard whose task returned or failed, as its chord's callback reports it."""

    job_id: str
    shard_index: int
    in_wave: bool = False
    """Its message was a wave's (`run_shards`), which has ended: see `settle.SettleBatch.examine`'s `ended_in_wave`."""


def endings_settle(endings: Iterable[ShardEnding | tuple[str, int]]) -> None:
    """Shards whose tasks returned or failed, settled together (`endings_inbox` gathers them): their rows
    are read in one statement and the committed ones written in one (`SettleBatch`), the usage ledger and
    the throughput fit once, each queue is scheduled once and each job is looked at for its merge once,
    however many shards and jobs ended.

    A job whose shard output contradicts its row fails; a database error goes up (the caller gives
    the endings back and the task retries); any other error leaves that job's shards to the
    reconciler's sweep and the other jobs are settled now."""
    by_job: defaultdict[str, dict[int, bool]] = defaultdict(dict)
    for job_id, index, in_wave in (ShardEnding(*ending) for ending in endings):
        by_job[str(job_id)][int(index)] = in_wave
    rows = Job.objects.select_related("model__gpu_class", "tenant").filter(pk__in=list(by_job))
    jobs = {str(job.pk): job for job in rows}
    unsettled = _unsettled({job_id: list(indexes) for job_id, indexes in by_job.items() if job_id in jobs})
    ledger = SettleLedger()
    batch = SettleBatch(ledger)
    examined: list[tuple[Job, list[tuple[Shard, Settled]]]] = []
    for job_id, indexes in by_job.items():
        job = jobs.get(job_id)
        if job is None:
            continue  # deleted since: nothing to settle
        waved = {index for index, ended_in_wave in indexes.items() if ended_in_wave}
        try:
            examined.append((job, batch.examine(job, unsettled[job_id], ended_in_wave=waved)))
        except (OperationalError, InterfaceError):
            raise
        except ValueError as exc:
            job_fail(job_id=job_id, reason=f"refused inconsistent shard output: {exc}")
        except Exception:
            logger.exception("job %s: settling shards %s failed; the reconciler tries again", job_id, sorted(indexes))
    batch.write()
    settled_jobs: list[Job] = []
    for job, outcomes in examined:
        try:
            _follow_up(job, outcomes)
        except (OperationalError, InterfaceError):
            raise
        except Exception:
            logger.exception("job %s: sending its shards again failed; the reconciler tries again", job.id)
            continue
        settled_jobs.append(job)
    ledger.flush()
    for queue in sorted({job_queue(job) for job in jobs.values()}):
        schedule_queue(queue)
    running = jobs_within_budget([job for job in settled_jobs if not merge_when_settled(job, inline_small=True)])
    for job in running:
        # Stitch what has finished now, so the merge at the end has only the tail left.
        if _advance_due(job):
            job_merge_advance(job_id=str(job.id), worker="settle")
    # A job that merges now tells its end instead (`job_ended`): a one-record job's ending asked for
    # its tenant's endpoints twice.
    jobs_progressed.send(sender=Job, jobs=running)


def _advance_due(job: Job) -> bool:
    """Whether settling stitches the job's finished shards ahead now: at most once every
    `ADVANCE_INTERVAL_S` a job. A stitch at every ending of a job running on many slots cost more than
    its settling (ten round trips and a storage read, mostly finding nothing new to stitch); the merge at
    the end stitches what is left. Without Redis, no stitching ahead (it needs a lease)."""
    try:
        return bool(redis_client().set(ADVANCE_KEY.format(job_id=job.id), 1, nx=True, ex=ADVANCE_INTERVAL_S))
    except redis.RedisError:
        return False


def _unsettled(indexes: dict[str, list[int]]) -> defaultdict[str, list[Shard]]:
    """Each job's shards of these indexes that are not settled yet, in index order, in one statement."""
    by_job: defaultdict[str, list[Shard]] = defaultdict(list)
    if not indexes:
        return by_job
    wanted = Q()
    for job_id, job_indexes in indexes.items():
        wanted |= Q(job_id=job_id, index__in=job_indexes)
    for shard in Shard.objects.filter(wanted, status__in=UNSETTLED).order_by("job_id", "index"):
        by_job[str(shard.job_id)].append(shard)
    return by_job


def _follow_up(job: Job, outcomes: list[tuple[Shard, Settled]]) -> None:
    """Send again the job's shards whose task was killed or worker lost; put back to wait those that arrived
    while it was paused."""
    for shard, settled in outcomes:
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


def merge_when_settled(job: Job, *, inline_small: bool = False) -> bool:
    """Send the merge of a running job none of whose shards of the current round is unsettled; with
    `inline_small`, a job of at most `BATCHERY_INLINE_MERGE_MAX_RECORDS` records merges in this call.

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
    if inline_small and records is not None and records <= settings.BATCHERY_INLINE_MERGE_MAX_RECORDS:
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
            job_merge(job_id=job_id, worker=f"settle:{os.getpid()}")
    except Exception:
        logger.warning(
            "job %s: merging in the settling callback failed; the merge task takes over", job_id, exc_info=True
        )
        _send_merge(job_id)


def _send_merge(job_id: str) -> None:
    send.send_merge(job_id)


def shards_requeue(*, job: Job, shards: Sequence[Shard], reason: str) -> int:
    """Put shards whose message was lost or whose task was killed back to pending; return how many.

    Each goes back only if it still carries the task id it was last sent with, so two reconcilers
    cannot both send it. A shard sent too often fails for good instead. The caller schedules.
    """
    requeued: list[Shard] = []
    for shard in shards:
        if shard.attempt >= SHARD_MAX_DISPATCHES:
            # Still dispatched: a shard whose last attempt committed and was settled meanwhile (by another
            # control process's callback) keeps its success.
            Shard.objects.filter(pk=shard.pk, status=ShardStatus.DISPATCHED, task_id=shard.task_id).update(
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
