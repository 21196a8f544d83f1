"""When the reconciler last finished a sweep, for /metrics and its "not sweeping" alert.

Kept in Redis beside the other live figures: losing it only shows the reconciler as late until its
next sweep, seconds later.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis

from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

LAST_SWEEP_KEY = "batchery:reconcile:last-sweep"


@dataclass(frozen=True)
class Sweep:
    finished_at: float
    """Unix time the sweep finished."""
    duration_s: float


def reconcile_sweep_record(*, duration_s: float) -> None:
    try:
        redis_client().set(LAST_SWEEP_KEY, json.dumps({"at": time.time(), "duration_s": duration_s}))
    except redis.RedisError as exc:
        logger.warning("reconcile sweep time not recorded: %s", exc)


def reconcile_last_sweep() -> Sweep | None:
    try:
        raw = redis_client().get(LAST_SWEEP_KEY)
    except redis.RedisError:
        return None
    if not raw:
        return None
    data = json.loads(raw)
    return Sweep(finished_at=float(data["at"]), duration_s=float(data["duration_s"]))
