"""Operators' actions on the fleet. Draining a slot: its Celery worker stops taking shards from its
queue and finishes the one it runs; it stays idle until restarted (the launcher restarts a slot
whose process exits, and a restarted worker consumes again)."""

from __future__ import annotations

import json
import logging
import time

from django.contrib.auth.models import User

from portal.audit.services import Target, actor_label, audit_record
from tasks.app import app
from tasks.shared.config import slot_own_queue
from tasks.shared.fleet import DRAINING_TTL_S, draining_key
from tasks.shared.redis_client import redis_client

logger = logging.getLogger(__name__)

# How long to wait for the worker to confirm; a live worker answers within milliseconds.
DRAIN_REPLY_TIMEOUT_S = 2.0


def slot_drain(*, worker: str, queue: str, actor: User | None) -> bool:
    """Tell the slot's worker (a Celery node name) to stop consuming `queue`, and its own queue
    (`slot_own_queue`); True once it confirms the first.

    Shards routed to its own queue and not yet taken are sent again by the reconciler, which sends
    nothing to a draining slot.

    A confirmed drain is marked in Redis, so the fleet page shows it, and audited. False when the
    worker did not answer: nothing is marked or recorded.
    """
    replies = app.control.cancel_consumer(queue, destination=[worker], reply=True, timeout=DRAIN_REPLY_TIMEOUT_S)
    if not any(worker in reply for reply in replies or []):
        logger.warning("drain of %s (%s): the worker did not answer", worker, queue)
        return False
    app.control.cancel_consumer(slot_own_queue(queue, worker), destination=[worker], reply=False)
    mark = {"queue": queue, "at": time.time(), "by": actor_label(actor)}
    redis_client().set(draining_key(worker), json.dumps(mark), ex=DRAINING_TTL_S)
    audit_record(
        actor=actor,
        action="slot.drained",
        target=Target("slot", worker),
        summary=f"slot {worker} drained: takes no new shards from {queue}",
    )
    logger.info("slot %s drained from %s", worker, queue)
    return True
