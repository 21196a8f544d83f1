"""Reads about the fleet that the portal and the admin share."""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser

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


def live_slot(worker: str) -> dict[str, Any] | None:
    """The heartbeat of the slot run by this Celery worker, if it is alive."""
    return next((slot for slot in fleet_slots() if worker and slot.get("worker") == worker), None)


def flower_link(user: AbstractBaseUser | AnonymousUser) -> str | None:
    """Flower's address for this user's fleet pages: staff only, since Flower shows every tenant's
    tasks and can stop workers."""
    return settings.BATCHERY_FLOWER_URL if getattr(user, "is_staff", False) else None
