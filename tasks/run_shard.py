"""The shard tasks: run on a GPU (or `cpu`) queue, touch no database, return a manifest: `run_shard`
one shard, `run_shards` a wave of short ones.

A message is acknowledged only after it ran. A worker that dies mid-shard and a soft time limit
(which ends the process, see below) put the message back on the queue; a hard time limit records a
failure that the merge sends again.
The attempt count kept in storage bounds how often either happens (see `tasks.shard_bisect`).
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from typing import Any

from celery import states
from celery.exceptions import SoftTimeLimitExceeded

from gpuworkers.faults import StickyDeviceError, raised_from
from gpuworkers.logs import bind_log_context
from gpuworkers.weights import WeightsUnavailableError
from tasks import heartbeat, preload, slot_metrics  # noqa: F401  (connect the slot's heartbeat, preloading and clock to its start)
from tasks.app import app
from tasks.config import WAVE_TASK
from tasks.shard_execution import execute_shard
from tasks.specs import ShardSpec
from tasks.storage import TransientStorageError

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


@app.task(name="batchery.run_shard", **_SHARD_TASK_OPTIONS)
def run_shard(self: Any, spec: dict[str, Any]) -> dict[str, Any]:
    return _execute(ShardSpec.from_dict(spec), worker=self.request.hostname or socket.gethostname())


@app.task(name=WAVE_TASK, **_SHARD_TASK_OPTIONS)
def run_shards(self: Any, shards: list[tuple[str, dict[str, Any]]]) -> int:
    """A wave of short shards in one message, `[task id, spec]` each (see `dispatch.shards_send`): each
    runs as `run_shard` would run it alone, and its outcome (manifest, skip, or failure) is stored under
    its own task id, where settling reads it. One message, one acknowledgement and one chord a wave,
    where each one-record shard paid for its own: those were most of such a shard's cost.

    A shard that fails fails alone; the next one runs. A worker lost or a time limit puts the whole
    message back (or ends it): its committed shards answer from their commit marker when it runs again,
    and its callback finds the shards that have no outcome (`settle.shard_settle`, `task_ended`)."""
    worker = self.request.hostname or socket.gethostname()
    for task_id, spec in shards:
        shard = ShardSpec.from_dict(spec)
        bind_log_context(job_id=shard.job_id, shard=shard.shard_index)
        try:
            outcome = _execute(shard, worker=worker)
        except RETRIED_ERRORS:
            raise
        except Exception as exc:
            logger.exception("shard %s/%d failed", shard.job_id, shard.shard_index)
            self.backend.store_result(task_id, exc, states.FAILURE, traceback=traceback.format_exc())
            continue
        self.backend.store_result(task_id, outcome, states.SUCCESS)
    return len(shards)


def _execute(shard: ShardSpec, *, worker: str) -> dict[str, Any]:
    try:
        return execute_shard(shard, worker=worker).to_dict()
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
