"""The shard tasks: run on a GPU (or `cpu`) queue, touch no database, return a manifest: `run_shard`
one shard, `run_shards` a wave of short ones.

A message is acknowledged only after it ran. A worker that dies mid-shard and a soft time limit
(which ends the process, see below) put the message back on the queue; a hard time limit records a
failure that the merge sends again.
The attempt count kept in storage bounds how often either happens (see `tasks.slot.shard_bisect`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from celery import states
from celery.exceptions import SoftTimeLimitExceeded

from gpuworkers.faults import StickyDeviceError, raised_from
from gpuworkers.logs import bind_log_context
from gpuworkers.weights import WeightsUnavailableError
from tasks.app import app
from tasks.shared.config import SHARD_TASK, WAVE_TASK
from tasks.shared.specs import ShardManifest, ShardSkipped, ShardSpec
from tasks.shared.storage import TransientStorageError

# Connected to the slot's start in this order: its clock, children allowed (before preloading, which may start
# some), its heartbeat, preloading.
from tasks.slot import busy_clock, children, heartbeat, preload  # noqa: F401
from tasks.slot.shard_execution import execute_shard

logger = logging.getLogger(__name__)

# A child process that exits with this code lost its GPU context; the pool starts a fresh one.
STICKY_DEVICE_EXIT_CODE = 70
# A child process that exits with this code was interrupted by its soft time limit.
INTERRUPTED_EXIT_CODE = 75  # EX_TEMPFAIL


# The store was unreachable for a moment (shard data, or a model's weights): the same message runs
# again after a backoff.
RETRIED_ERRORS = (TransientStorageError, WeightsUnavailableError)
_SHARD_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": RETRIED_ERRORS,
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": 5,
}


@app.task(name=SHARD_TASK, **_SHARD_TASK_OPTIONS)
def run_shard(self: Any, spec: dict[str, Any]) -> dict[str, Any]:
    return _execute(ShardSpec.from_dict(spec), worker=self.request.hostname or socket.gethostname()).to_dict()


@app.task(name=WAVE_TASK, **_SHARD_TASK_OPTIONS)
def run_shards(self: Any, shards: list[tuple[str, dict[str, Any], float]]) -> int:
    """A wave of short shards in one message, `[task id, spec, soft time limit]` each (see
    `dispatch.shards_send`): each runs as `run_shard` would run it alone, under its own soft time limit.
    What settling reads of a shard that did not commit (its skip, or its failure) is stored under its
    own task id; a committed shard's outcome is its commit marker, which settling reads first, so
    nothing more is stored for it. One message, one acknowledgement and one chord a wave, where each
    one-record shard paid for its own: those were most of such a shard's cost.

    A shard that fails fails alone; the next one runs. A worker lost or a time limit puts the whole
    message back (or ends it): its committed shards answer from their commit marker when it runs again,
    and its callback finds the shards that have no outcome (`settle.SettleBatch.examine`, `ended_in_wave`)."""
    worker = self.request.hostname or socket.gethostname()
    for task_id, spec, soft_time_limit in shards:
        shard = ShardSpec.from_dict(spec)
        bind_log_context(job_id=shard.job_id, shard=shard.shard_index)
        try:
            outcome = _execute(shard, worker=worker, soft_time_limit=soft_time_limit)
        except RETRIED_ERRORS:
            raise
        except Exception as exc:
            logger.exception("shard %s/%d failed", shard.job_id, shard.shard_index)
            self.backend.store_result(task_id, exc, states.FAILURE, traceback=traceback.format_exc())
            continue
        if isinstance(outcome, ShardSkipped):
            self.backend.store_result(task_id, outcome.to_dict(), states.SUCCESS)
    return len(shards)


@contextmanager
def shard_soft_time_limit(seconds: float) -> Iterator[None]:
    """Raise `SoftTimeLimitExceeded` in this thread after `seconds`, as Celery's soft time limit does for
    a whole message: each shard of a wave keeps the limit it has alone (a model's load included), so
    that a hanging shard is caught as soon as alone, not after its whole wave's time.

    A timer signal reaches the main thread only (a pool process runs its tasks there), and the process
    has one such timer: in another thread, or where someone else's timer is armed, the message's own
    limits stand alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise SoftTimeLimitExceeded(f"the shard passed its soft time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _execute(shard: ShardSpec, *, worker: str, soft_time_limit: float | None = None) -> ShardManifest | ShardSkipped:
    """Run the shard (under its own soft time limit, if given: the timer's whole span is in here, so that
    wherever the limit strikes it ends the process as Celery's own limit does)."""
    try:
        if soft_time_limit is None:
            return execute_shard(shard, worker=worker)
        with shard_soft_time_limit(soft_time_limit):
            return execute_shard(shard, worker=worker)
    except StickyDeviceError:
        # The CUDA context is unusable for every later shard in this process: leave, and let the
        # pool start a fresh process; the message goes back to the queue as for a lost worker.
        logger.exception("shard %s/%d hit a sticky device error; exiting", shard.job_id, shard.shard_index)
        os._exit(STICKY_DEVICE_EXIT_CODE)
    except Exception as exc:
        if not raised_from(exc, (SoftTimeLimitExceeded,)):
            raise
        # The limit struck at an arbitrary point (an engine may have wrapped it): in a lazy import (a
        # half-imported torch fails every later import), in a model load, or in an engine mid-step
        # (vLLM keeps the interrupted requests). Nothing in this process can be trusted: leave, as
        # above, and let a fresh process take the message again.
        logger.warning("shard %s/%d passed its soft time limit; exiting", shard.job_id, shard.shard_index)
        os._exit(INTERRUPTED_EXIT_CODE)
