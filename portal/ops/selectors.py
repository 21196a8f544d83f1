"""Reads about the fleet that the portal and the admin share.

A fleet of a thousand slots is too long for one page (its table was 1 MB of HTML, polled every 2 s by
each open page): the pages show a line per GPU class (`fleet_classes`) and the slots of a page of
hosts (`fleet_hosts_page`).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.core.paginator import Page, Paginator

from tasks.shared.fleet import draining_key, live_beats
from tasks.shared.redis_client import redis_client


def fleet_slots() -> list[dict[str, Any]]:
    """Every slot whose heartbeat is still alive, by host and slot; empty when Redis cannot be read."""
    try:
        beats = live_beats(redis_client())
    except redis.RedisError:
        return []
    return [json.loads(value) for value in beats]


def draining_workers(workers: Collection[str]) -> set[str]:
    """Those of these Celery worker names that were drained (see `portal.ops.services.slot_drain`)."""
    names = [name for name in workers if name]
    if not names:
        return set()
    try:
        marks = redis_client().mget([draining_key(name) for name in names])
    except redis.RedisError:
        return set()
    return {name for name, mark in zip(names, marks, strict=True) if mark}


def fleet_overview() -> list[dict[str, Any]]:
    """The live slots with, besides their heartbeat, `age_s` (seconds since it was sent) and `draining`."""
    slots = fleet_slots()
    draining = draining_workers([slot.get("worker", "") for slot in slots])
    now = time.time()
    return [
        {**slot, "age_s": max(0.0, now - slot["at"]), "draining": slot.get("worker", "") in draining} for slot in slots
    ]


FLEET_HOSTS_PER_PAGE = 16
"""Hosts whose slots a fleet page shows: 128 slots of hosts of 8."""

SlotT = TypeVar("SlotT")


@dataclass(frozen=True)
class HostSlots:
    host: str
    slots: list[Any]


def fleet_hosts_page(slots: Sequence[SlotT], *, host: Callable[[SlotT], str], page: str | None) -> Page:
    """A page (`page`, a number as a query gives it; the first when absent or out of range) of the
    hosts of these slots, sorted by host, each a `HostSlots` with its slots."""
    hosts = [HostSlots(name, list(group)) for name, group in itertools.groupby(slots, key=host)]
    return Paginator(hosts, FLEET_HOSTS_PER_PAGE).get_page(page)


@dataclass(frozen=True)
class ClassSummary:
    """One GPU class's slots, counted."""

    gpu_class: str
    hosts: int
    slots: int
    busy: int
    """Slots running a shard."""
    draining: int
    own: int
    """Slots running a shard of the jobs named in `fleet_classes`'s `own_jobs` (the viewer's)."""
    utilization: float | None
    """Mean GPU utilization (%) of the class's devices that report it."""

    @property
    def idle(self) -> int:
        return self.slots - self.busy


def fleet_classes(beats: Iterable[Mapping[str, Any]], *, own_jobs: Collection[str] = ()) -> list[ClassSummary]:
    """A summary per GPU class of these heartbeats (`fleet_slots`' or `fleet_overview`'s), by class."""
    by_class: dict[str, list[Mapping[str, Any]]] = {}
    for beat in beats:
        by_class.setdefault(str(beat.get("gpu_class", "")), []).append(beat)
    summaries = []
    for gpu_class, slots in sorted(by_class.items()):
        jobs = [str(slot.get("current_shard") or "").partition("/")[0] for slot in slots]
        readings = [
            float(reading["utilization"])
            for slot in slots
            for reading in slot.get("telemetry") or []
            if isinstance(reading.get("utilization"), int | float)
        ]
        summaries.append(
            ClassSummary(
                gpu_class=gpu_class,
                hosts=len({slot.get("host") for slot in slots}),
                slots=len(slots),
                busy=sum(bool(job) for job in jobs),
                draining=sum(bool(slot.get("draining")) for slot in slots),
                own=sum(job in own_jobs for job in jobs if job),
                utilization=sum(readings) / len(readings) if readings else None,
            )
        )
    return summaries


def live_slot(worker: str) -> dict[str, Any] | None:
    """The heartbeat of the slot run by this Celery worker, if it is alive."""
    return next((slot for slot in fleet_slots() if worker and slot.get("worker") == worker), None)


def flower_link(user: AbstractBaseUser | AnonymousUser) -> str | None:
    """Flower's address for this user's fleet pages: staff only, since Flower shows every tenant's
    tasks and can stop workers."""
    return settings.BATCHERY_FLOWER_URL if getattr(user, "is_staff", False) else None
