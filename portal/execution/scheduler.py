"""The scheduler: which waiting shards each GPU queue sends, and when.

A tick of a queue (`schedule_queue`) reads, under the queue's lock, what it decides from (`QueueState`:
its live slots, its shards in flight, its waiting jobs by tenant with their decayed usage); `decide`, a
pure function, shares the window's free places between the waiting jobs in fair-share order
(`DispatchPlan`); the tick marks the chosen rows dispatched and charges their estimates in one
transaction, and `dispatch.shards_send` sends them once it commits. Ticks run where places free up
(`endings`), where a job's shards appear (planning, retry, resume) and at each sweep (`schedule_all`);
with nothing left to send, idle slots get copies of stragglers. Everything a tick reads is in
PostgreSQL but the live slots, so after Redis is lost the next sweep rebuilds the queues. A job that names
LoRA adapters has its shards sent to slots that hold them where they have room (`adapter_routes`). The
story is told in docs/architecture.md (Fair share).
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, replace

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F, OuterRef, Subquery
from django.utils import timezone

from portal.execution.adapter_routes import AdapterRoutes, adapter_routes, job_fingerprints
from portal.execution.capacity import live_slots, queue_slots, wave_for, window_for
from portal.execution.costs import shard_cost_estimate, shard_seconds_estimate
from portal.execution.decayed_usage import usage_charge, usage_read
from portal.execution.dispatch import (
    job_queue,
    new_dispatch_tag,
    new_task_id,
    shards_send,
    task_id_column,
)
from portal.execution.fair_share import TenantQueue, WaitingJob, share_out
from portal.execution.locks import lock_until_commit, taken_until_commit
from portal.execution.own_queues import own_queues_note
from portal.execution.queue_reads import Waiting, long_shard_seconds, queue_waiting, window_reading
from portal.jobs.models import SCHEDULABLE, UNSETTLED, Job, JobStatus, Shard, ShardStatus
from portal.jobs.selectors import queue_jobs
from tasks import send
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueState:
    """What a tick of one queue decides from, read under the queue's lock."""

    live_slots: int
    """Slots consuming the queue, by their heartbeats; 0 where none is known (the default window)."""
    in_flight: int
    """The queue's shards sent and not yet ended."""
    tenants: list[TenantQueue]
    """The jobs with shards waiting, by tenant, with each tenant's decayed usage and weight."""
    gpus_per_replica: int
    """GPUs a replica of the queue's models spans: a shard's GPU-seconds over this are its seconds."""
    longest_seconds: float = 0.0
    """Seconds a waiting shard of the queue is known to last at least, beside the tenants' own figures,
    which count the first few waiting shards of each job only."""


@dataclass(frozen=True)
class DispatchPlan:
    """What a tick sends: shards of each job, in fair-share order, in chords of at most `wave` shards."""

    shards: dict[str, int]
    """Job id -> how many of its waiting shards to send now (its first ones by index)."""
    wave: int
    """The most shards of a job in one chord (`capacity.wave_for`)."""


def decide(state: QueueState) -> DispatchPlan:
    """The places free in the queue's window, shared out between the waiting jobs (`fair_share.share_out`).

    The window is sized by the longest waiting shard (a tenant arriving next waits behind no more than
    a slot's places of it). Reads nothing: every fact is in `state`."""
    longest = max((job.shard_cost for tenant in state.tenants for job in tenant.jobs), default=0.0)
    shard_seconds = max(longest / state.gpus_per_replica, state.longest_seconds)
    wave = wave_for(state.live_slots, shard_seconds)
    free = window_for(state.live_slots, shard_seconds) - state.in_flight
    if free <= 0:
        return DispatchPlan(shards={}, wave=wave)
    # `share_out` charges as it chooses: it works on copies, so that `state` stays as it was read.
    tenants = [replace(tenant, jobs=[copy.copy(job) for job in tenant.jobs]) for tenant in state.tenants]
    chosen, _ = share_out(free, tenants)
    return DispatchPlan(shards=dict(chosen), wave=wave)


AGAIN_KEY = "batchery:schedule:{queue}:again"
"""Set by a tick that found its queue's lock held: the holder ticks once more after letting go."""
AGAIN_TTL_S = 60
AGAIN_ROUNDS = 8


def _lock_queue(queue: str, *, wait: bool) -> bool:
    """Serialize the ticks of one queue (until the transaction ends), so two never fill the same places;
    without `wait`, whether the lock was free."""
    name = f"batchery:schedule:{queue}"
    if wait:
        lock_until_commit(name)
        return True
    return taken_until_commit(name)


def schedule_queue(queue: str) -> int:
    """Fill the queue's free places with waiting shards in fair-share order; return how many this call
    sent.

    A tick that finds another tick of its queue under way does not wait for it: it asks the holder to
    tick once more (`AGAIN_KEY`) and returns. Waiting, every settling callback and every planner of a
    busy queue queued on its lock, each then to read again what the one before had just decided from;
    asked, one holder ticks once for all who asked meanwhile. The asker tries the lock again after
    asking, so a holder that let go before the ask is no matter, and a holder that lets go after it
    finds the ask. Without Redis, ticks wait for the lock as before."""
    if _nothing_to_send():
        return 0
    again = _Again(queue)
    sent = _tick_or_ask(queue, again)
    if sent is None:
        # Asked (the holder ticks again for us), or, without Redis to ask through, wait for the lock.
        return 0 if again.usable else _tick(queue, wait=True) or 0
    # Bounded: under a steady flow of asks one call would tick for everyone forever. An ask left
    # is taken by the next tick's holder, or by the sweep's.
    for _ in range(AGAIN_ROUNDS):
        if not again.taken() or (more := _tick_or_ask(queue, again)) is None:
            break
        sent += more
    return sent


def _tick_or_ask(queue: str, again: _Again) -> int | None:
    """A tick if the queue's lock is free; else ask its holder to tick again, then try once more (it may
    have let go before the ask). None: asked, or not (`again.usable` false)."""
    sent = _tick(queue, wait=False)
    if sent is None and again.ask():
        sent = _tick(queue, wait=False)
    return sent


class _Again:
    """The queue's ask-again mark in Redis; unusable once Redis fails."""

    def __init__(self, queue: str) -> None:
        self._key = AGAIN_KEY.format(queue=queue)
        self._client = redis_client()
        self.usable = True

    def ask(self) -> bool:
        try:
            self._client.set(self._key, 1, ex=AGAIN_TTL_S)
            return True
        except redis.RedisError:
            self.usable = False
            return False

    def taken(self) -> bool:
        """Whether a tick was asked for since the last look (and take the ask)."""
        if not self.usable:
            return False
        try:
            return bool(self._client.delete(self._key))
        except redis.RedisError:
            self.usable = False
            return False


def _tick(queue: str, *, wait: bool) -> int | None:
    """One tick of the queue; None where `wait` is false and another tick holds the queue."""
    started = time.perf_counter()
    claimed: list[tuple[Job, list[Shard]]] = []
    with transaction.atomic():
        if not _lock_queue(queue, wait=wait):
            return None
        live = live_slots(queue)
        long_seconds = long_shard_seconds()
        in_flight, long_waiting = window_reading(queue, long_seconds)
        if long_waiting and window_for(live, long_seconds) <= in_flight:
            return 0  # full: most ticks of a busy fleet, read in two index lookups
        # A job takes at most the free places in one tick: reading more of its waiting shards tells nothing.
        # With only short shards waiting, their lengths size the window: as many places as it may have.
        shortest = settings.BATCHERY_SCHEDULER_SECONDS_AHEAD / settings.BATCHERY_SCHEDULER_MAX_SHARDS_PER_SLOT
        free = window_for(live, long_seconds if long_waiting else shortest) - in_flight
        waiting = queue_waiting(queue, cap=max(1, free))
        if not waiting:
            # A job still planning has more shards coming: its running ones are not stragglers yet.
            jobs = queue_jobs(queue, statuses=SCHEDULABLE)
            done_planning = [job for job in jobs if job.status != JobStatus.PLANNING]
            running = Shard.objects.filter(job__in=done_planning, status=ShardStatus.DISPATCHED).count()
            copies = _speculate(queue, done_planning, in_flight) if settings.BATCHERY_SPECULATION and running else []
            transaction.on_commit(lambda: _send_copies(copies))
            return len(copies)
        gpu_class_id = waiting[0].gpu_class_id
        tenant_queues, firsts = _tenant_queues(waiting, gpu_class_id)
        state = QueueState(
            live_slots=live,
            in_flight=in_flight,
            tenants=tenant_queues,
            gpus_per_replica=waiting[0].gpus_per_replica,
            longest_seconds=long_seconds if long_waiting else 0.0,
        )
        plan = decide(state)
        if not plan.shards:
            return 0
        # Only the jobs the tick sends shards of are read whole (their model and tenant go in the messages).
        by_id = {str(job.id): job for job in queue_jobs(queue, statuses=SCHEDULABLE, among=list(plan.shards))}
        charges: dict[int, float] = defaultdict(float)
        now = timezone.now()
        routes: AdapterRoutes | None = None
        for job_id, count in plan.shards.items():
            job = by_id.get(job_id)
            if job is None:
                continue  # stopped since its counts were read
            if count == 1 and job_id in firsts:
                shards = [firsts[job_id]]  # read under this tick's lock: still the job's first waiting shard
            else:
                pending = Shard.objects.filter(job_id=job_id, status=ShardStatus.PENDING).order_by("index")
                shards = list(pending[:count])
            tag = new_dispatch_tag()
            shards = _mark_dispatched(job, shards, now, tag)
            if job.adapters and shards:
                routes = routes or adapter_routes(queue)
                _route(shards, routes, job_fingerprints(job))
            for shard in shards:
                shard.status = ShardStatus.DISPATCHED
                shard.task_id = new_task_id(job, shard, tag)
                shard.attempt += 1
                shard.dispatched_at = now
                charges[job.tenant_id] += shard_cost_estimate(job, shard)
            claimed.append((job, shards))
        usage_charge(charges=charges, gpu_class_id=gpu_class_id, now=now)
    # Rows first, one commit, then the messages: a crash in between leaves shards marked dispatched
    # with no message, which the reconciler sends again; the reverse would run shards the database
    # does not know were sent. Own queues are noted before their messages go, so that none is left unknown.
    if routed := {shard.slot_queue for _, shards in claimed for shard in shards if shard.slot_queue}:
        own_queues_note(queue, routed)
    for job, shards in claimed:
        shards_send(job, shards, wave=plan.wave)
    sent = sum(len(shards) for _, shards in claimed)
    # The tick's time, its messages sent, is what `manage.py simulate` reads of the scheduler's cost.
    milliseconds = (time.perf_counter() - started) * 1000
    logger.info(
        "scheduled %d shards on %s in %.1f ms: %s",
        sent,
        queue,
        milliseconds,
        {str(job.id): len(s) for job, s in claimed},
    )
    return sent


def _mark_dispatched(job: Job, shards: list[Shard], now: dt.datetime, tag: str) -> list[Shard]:
    """Mark the job's chosen shards dispatched, in one UPDATE whose task ids SQL makes from each row's
    index and the tick's `tag` (`bulk_update`'s CASE for every column, and then a CASE of the task ids
    alone, cost more CPU than the rest of a tick); return those this tick claimed.

    Only rows still pending are claimed. The queue's lock keeps other ticks out, not the settling of a
    shard sent again (`endings.shards_requeue`) whose first attempt's late callback, in another
    control process, finds it committed: marked dispatched over that, it would be sent, settled and
    charged a second time."""
    if not shards:
        return []
    claimed = Shard.objects.filter(pk__in=[shard.pk for shard in shards], status=ShardStatus.PENDING).update(
        status=ShardStatus.DISPATCHED,
        dispatched_at=now,
        attempt=F("attempt") + 1,
        task_id=task_id_column(job, tag),
        slot_queue="",
    )
    for shard in shards:
        shard.slot_queue = ""
    if claimed == len(shards):
        return shards
    # Rare (a settling raced this tick): those claimed carry this tick's tag.
    mine = set(
        Shard.objects.filter(pk__in=[shard.pk for shard in shards], task_id__endswith=f"-{tag}").values_list(
            "pk", flat=True
        )
    )
    logger.info(
        "job %s: %d of %d shards settled before this tick could send them", job.id, len(shards) - claimed, len(shards)
    )
    return [shard for shard in shards if shard.pk in mine]


def _route(shards: list[Shard], routes: AdapterRoutes, fingerprints: frozenset[str]) -> None:
    """Send each of a job's claimed shards to a slot holding its adapters where one has room
    (`adapter_routes`), saved on the rows before any message goes."""
    by_queue: dict[str, list[int]] = defaultdict(list)
    for shard in shards:
        shard.slot_queue = routes.route(fingerprints)
        if shard.slot_queue:
            by_queue[shard.slot_queue].append(shard.pk)
    for slot_queue, pks in by_queue.items():
        Shard.objects.filter(pk__in=pks).update(slot_queue=slot_queue)


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


def _tenant_queues(jobs: list[Waiting], gpu_class_id: int) -> tuple[list[TenantQueue], dict[str, Shard]]:
    """The waiting jobs by tenant, for `share_out`; and the first waiting shard of each job whose shards
    have no estimate, read for its cost, which a tick that sends it one shard sends without reading again.

    A job's shard cost is its longest waiting shard's estimate (its first waiting one's where none has
    an estimate). Its first shards are cut short, for a fast first result: sized by them, the window of
    a job that has just started would hold many times the work it means to, and a tenant arriving next
    would wait behind all of it."""
    usage = usage_read(tenant_ids={job.tenant_id for job in jobs}, gpu_class_id=gpu_class_id)
    tenants: dict[int, TenantQueue] = {}
    firsts = _first_waiting([job.id for job in jobs if job.longest is None])
    for job in jobs:
        tenant = tenants.setdefault(
            job.tenant_id, TenantQueue(tenant_id=job.tenant_id, weight=job.weight, usage=usage[job.tenant_id])
        )
        seconds = job.longest if job.longest is not None else shard_seconds_estimate(firsts.get(job.id))
        tenant.jobs.append(
            WaitingJob(
                job_id=job.id,
                priority=job.priority,
                created_at=job.created_at.timestamp(),
                pending=job.pending,
                shard_cost=seconds * job.gpus_per_replica,
            )
        )
    return list(tenants.values()), firsts


def _first_waiting(job_ids: list[str]) -> dict[str, Shard]:
    """Each job's first waiting shard, in one query: a query a job made a tick of a queue with a
    hundred waiting jobs cost half the control plane's CPU (`manage.py simulate`)."""
    if not job_ids:
        return {}
    first = Shard.objects.filter(job_id=OuterRef("pk"), status=ShardStatus.PENDING).order_by("index").values("pk")
    firsts = Job.objects.filter(pk__in=job_ids).annotate(first=Subquery(first[:1])).values("first")
    return {str(shard.job_id): shard for shard in Shard.objects.filter(pk__in=Subquery(firsts))}


def schedule_job(*, job_id: str) -> None:
    """A job's shards wait (its planner wrote some, it was planned or retried): send what its queue has
    room for; a job without shards merges."""
    job = Job.objects.select_related("model__gpu_class", "tenant").get(pk=job_id)
    if job.status not in SCHEDULABLE:
        logger.info("job %s is %s; not scheduling", job_id, job.status)
        return
    if not job.shards.exists():
        send.send_merge(job_id)
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
