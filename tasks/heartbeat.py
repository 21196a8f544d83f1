"""Slot heartbeats: each slot's worker process writes its state to Redis with a TTL.

The portal lists the fleet from these keys; a slot that dies stops renewing and drops out within
one TTL. Only processes started by the launcher (which sets BATCHERY_SLOT) send heartbeats.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

import redis
from celery.signals import worker_process_init, worker_process_shutdown

from gpuworkers.cache import process_cache
from gpuworkers.telemetry import gpu_telemetry
from tasks import slot_state
from tasks.env import env_int
from tasks.redis_client import redis_client

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = env_int("BATCHERY_HEARTBEAT_INTERVAL_S", 5, minimum=1)
HEARTBEAT_TTL_S = 3 * HEARTBEAT_INTERVAL_S
FLEET_KEY_PREFIX = "batchery:fleet:"
_stop = threading.Event()


def heartbeat_key(host: str, slot: str) -> str:
    """One key per slot: a host may run launchers of several classes, each numbering its slots."""
    devices = os.environ.get("CUDA_VISIBLE_DEVICES") or "-"
    return f"{FLEET_KEY_PREFIX}{host}:{os.environ.get('BATCHERY_GPU_CLASS', '')}:{slot}:{devices}"


def _devices() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(part) for part in visible.split(",") if part.strip().isdigit()]


def slot_heartbeat() -> dict[str, Any]:
    gpus = _devices()
    return {
        "host": socket.gethostname(),
        "slot": os.environ.get("BATCHERY_SLOT", ""),
        "gpu_class": os.environ.get("BATCHERY_GPU_CLASS", ""),
        "gpus": gpus,
        "pid": os.getpid(),
        "loaded_models": [f"{name}@{version}" for name, version in process_cache().resident()],
        "current_shard": slot_state.current_shard,
        "telemetry": gpu_telemetry(gpus),
        "at": time.time(),
    }


def _beat(key: str) -> None:
    while True:
        try:
            redis_client().set(key, json.dumps(slot_heartbeat()), ex=HEARTBEAT_TTL_S)
        except redis.RedisError as exc:
            logger.warning("heartbeat not sent: %s", exc)
        if _stop.wait(HEARTBEAT_INTERVAL_S):
            return


@worker_process_init.connect
def start_heartbeat(**_: Any) -> None:
    slot = os.environ.get("BATCHERY_SLOT")
    if slot is None:
        return
    key = heartbeat_key(socket.gethostname(), slot)
    threading.Thread(target=_beat, args=(key,), name="heartbeat", daemon=True).start()


@worker_process_shutdown.connect
def stop_heartbeat(**_: Any) -> None:
    slot = os.environ.get("BATCHERY_SLOT")
    if slot is None:
        return
    _stop.set()
    try:
        redis_client().delete(heartbeat_key(socket.gethostname(), slot))
    except redis.RedisError:
        return
