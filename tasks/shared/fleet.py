"""The fleet's keys in Redis: each slot's heartbeat (with a TTL), its last-seen time and the draining marks.

Slots write them (`tasks.slot.heartbeat`); the portal reads them to list the fleet and drain workers.
"""

from __future__ import annotations

import os

from gpuworkers.settings import slot_gpu_class
from tasks.shared.config import HEARTBEAT_INTERVAL_S

HEARTBEAT_TTL_S = 3 * HEARTBEAT_INTERVAL_S
FLEET_KEY_PREFIX = "batchery:fleet:"
# Every slot's last heartbeat time, by heartbeat key: outlives the beat itself, so that /metrics can
# show a slot whose heartbeat stopped (an alert), until the slot stops cleanly or a day has passed.
LAST_SEEN_KEY = "batchery:fleet-last-seen"
DRAINING_KEY_PREFIX = "batchery:draining:"
# A drained worker stays idle until it is restarted, which clears the mark; this only bounds a
# mark left by a worker that vanished.
DRAINING_TTL_S = 7 * 24 * 3600


def heartbeat_key(host: str, slot: str, *, gpu_class: str | None = None, devices: str | None = None) -> str:
    """One key per slot: a host may run launchers of several classes, each numbering its slots.

    The class and the devices (`CUDA_VISIBLE_DEVICES`'s form, `-` for none) default to this process's
    own; a writer of many slots' beats (the fleet simulator) names each slot with them.
    """
    if gpu_class is None:
        gpu_class = slot_gpu_class()
    if devices is None:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES") or "-"
    return f"{FLEET_KEY_PREFIX}{host}:{gpu_class}:{slot}:{devices or '-'}"


def draining_key(worker: str) -> str:
    """Set while the slot worker of this Celery node name takes no new shards."""
    return f"{DRAINING_KEY_PREFIX}{worker}"
