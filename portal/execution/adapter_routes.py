"""Adapter routes: which slot a shard of a job that names LoRA adapters is sent to.

A slot's heartbeat names its own queue (`tasks.shared.config.slot_own_queue`) and, by fingerprint
(`gpuworkers.spec.AdapterSpec.fingerprint`), the adapters it holds. A tick sends each shard of a job with
adapters to the own queue of the live, undrained slot of its class that holds the most of the job's
adapters, while that slot has fewer than `BATCHERY_SCHEDULER_SHARDS_PER_SLOT` routed shards in flight
(the one it runs and the next); every other shard goes to the class queue, where any slot takes it and
loads what it lacks. So no shard waits on an adapter download while a slot that holds the adapter has
room, and a busy holder does not hold a job up: its other shards run beside it, each slot loading the
adapter once. A routed shard whose slot stops consuming (dead, drained) is sent again by the reconciler
(`slot_takes`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Count

from gpuworkers.spec import AdapterSpec
from portal.execution.capacity import live_beats
from portal.jobs.models import Job, Shard, ShardStatus


@dataclass(frozen=True)
class Holder:
    """A slot that takes shards on its own queue, and the adapters it holds."""

    own_queue: str
    adapters: frozenset[str]


def job_fingerprints(job: Job) -> frozenset[str]:
    """The fingerprints of the adapters the job names (`Job.adapters`, saved by its planner)."""
    return frozenset(AdapterSpec.from_dict(entry["spec"]).fingerprint for entry in (job.adapters or {}).values())


class AdapterRoutes:
    """One tick's routing of the shards it sends: each to a holder with room, or to the class queue ("")."""

    def __init__(self, holders: list[Holder], in_flight: Counter[str], places: int) -> None:
        self._holders = holders
        self._in_flight = in_flight
        self._places = places

    def route(self, fingerprints: frozenset[str]) -> str:
        """The own queue of the slot holding the most of `fingerprints` that has room (the least loaded
        among equals), counting the shard in its flight; "" where none has: the class queue."""
        best: tuple[int, int] | None = None
        chosen = ""
        for holder in self._holders:
            held = len(holder.adapters & fingerprints)
            loaded = self._in_flight[holder.own_queue]
            if not held or loaded >= self._places:
                continue
            if best is None or (held, -loaded) > best:
                best, chosen = (held, -loaded), holder.own_queue
        if chosen:
            self._in_flight[chosen] += 1
        return chosen


def adapter_routes(queue: str) -> AdapterRoutes:
    """The routes of the class queue `queue` now: its slots holding adapters, with the routed shards each
    has in flight (one query, made only where some slot holds an adapter)."""
    holders = [
        Holder(own_queue=beat["own_queue"], adapters=frozenset(beat["adapters"]))
        for beat in live_beats(queue)
        if beat.get("own_queue") and beat.get("adapters")
    ]
    in_flight: Counter[str] = Counter()
    if holders:
        rows = (
            Shard.objects.filter(status=ShardStatus.DISPATCHED, slot_queue__in=[holder.own_queue for holder in holders])
            .values("slot_queue")
            .annotate(count=Count("id"))
        )
        in_flight.update({row["slot_queue"]: row["count"] for row in rows})
    return AdapterRoutes(holders, in_flight, settings.BATCHERY_SCHEDULER_SHARDS_PER_SLOT)


def slot_takes(own_queue: str, queue: str) -> bool:
    """Whether a live, undrained slot of `queue` consumes `own_queue`: a message waiting there will run."""
    return any(beat.get("own_queue") == own_queue for beat in live_beats(queue))
