"""Slot heartbeats: each slot's worker process writes its state to Redis with a TTL.

The portal lists the fleet from these keys; a slot that dies stops renewing and drops out within
one TTL. Only processes started by the launcher (which sets BATCHERY_SLOT) send heartbeats. A beat
names the slot's Celery worker and queues (BATCHERY_WORKER_NAME, BATCHERY_QUEUE, BATCHERY_OWN_QUEUE, also
set by the launcher) so that operators can drain it, and the LoRA adapters it holds, by fingerprint, so that
the scheduler can send it the shards that name them; a drained worker is marked under `draining_key`.
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
from celery.signals import worker_process_init, worker_process_shutdown, worker_ready
from redis.client import Pipeline

from gpuworkers.cache import process_cache
from gpuworkers.settings import slot_gpu_class, slot_name, slot_own_queue, slot_queue, slot_worker_name
from gpuworkers.telemetry import gpu_telemetry
from tasks.shared.config import HEARTBEAT_INTERVAL_S
from tasks.shared.fleet import FLEET_INDEX_KEY, HEARTBEAT_TTL_S, LAST_SEEN_KEY, draining_key, heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.slot import state as slot_state

logger = logging.getLogger(__name__)

_stop = threading.Event()


def _devices() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [int(part) for part in visible.split(",") if part.strip().isdigit()]


def slot_heartbeat() -> dict[str, Any]:
    gpus = _devices()
    return {
        "host": socket.gethostname(),
        "slot": slot_name(),
        "gpu_class": slot_gpu_class(),
        "gpus": gpus,
        "pid": os.getpid(),
        "worker": slot_worker_name(),
        "queue": slot_queue(),
        "own_queue": slot_own_queue(),
        "loaded_models": [f"{name}@{version}" for name, version in process_cache().resident()],
        # Fingerprints, not names: the fleet's beats are read by every operator, and name no tenant's adapter.
        "adapters": process_cache().loaded_adapters(),
        "current_shard": slot_state.current_shard,
        "telemetry": gpu_telemetry(gpus),
        "at": time.time(),
    }


def heartbeat_commands(pipe: Pipeline, key: str, beat: dict[str, Any]) -> None:
    """Queue on `pipe` the writes of one beat (`slot_heartbeat`'s shape) of the slot named `key`
    (`heartbeat_key`): for every writer of beats, a slot's thread or a simulated slot."""
    pipe.set(key, json.dumps(beat), ex=HEARTBEAT_TTL_S)
    pipe.sadd(FLEET_INDEX_KEY, key)
    pipe.hset(LAST_SEEN_KEY, key, json.dumps({k: beat[k] for k in ("host", "slot", "gpu_class", "at")}))


def heartbeat_clear_commands(pipe: Pipeline, key: str) -> None:
    """Queue on `pipe` what a slot that stops cleanly removes: its beat, its place in the index and its
    last-seen time (no alert)."""
    pipe.delete(key)
    pipe.srem(FLEET_INDEX_KEY, key)
    pipe.hdel(LAST_SEEN_KEY, key)


def _beat(key: str) -> None:
    while True:
        try:
            pipe = redis_client().pipeline(transaction=False)
            heartbeat_commands(pipe, key, slot_heartbeat())
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("heartbeat not sent: %s", exc)
        if _stop.wait(HEARTBEAT_INTERVAL_S):
            return


@worker_process_init.connect
def start_heartbeat(**_: Any) -> None:
    slot = slot_name()
    if not slot:
        return
    key = heartbeat_key(socket.gethostname(), slot)
    threading.Thread(target=_beat, args=(key,), name="heartbeat", daemon=True).start()


@worker_ready.connect
def clear_draining_mark(**_: Any) -> None:
    """A slot worker that (re)starts consumes its queue again, whatever an earlier drain said."""
    worker = slot_worker_name()
    if not worker:
        return
    try:
        redis_client().delete(draining_key(worker))
    except redis.RedisError as exc:
        logger.warning("draining mark of %s not cleared: %s", worker, exc)


@worker_process_shutdown.connect
def stop_heartbeat(**_: Any) -> None:
    slot = slot_name()
    if not slot:
        return
    _stop.set()
    key = heartbeat_key(socket.gethostname(), slot)
    try:
        pipe = redis_client().pipeline(transaction=False)
        heartbeat_clear_commands(pipe, key)
        pipe.execute()
    except redis.RedisError:
        return
