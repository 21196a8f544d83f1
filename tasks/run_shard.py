"""The shard task: runs on a GPU (or `cpu`) queue, touches no database, returns a manifest.

Its message is acknowledged only after it ran. A worker that dies mid-shard and a soft time limit
(which ends the process, see below) put the message back on the queue; a hard time limit records a
failure that the merge sends again.
The attempt count kept in storage bounds how often either happens (see `tasks.shard_bisect`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from gpuworkers.faults import StickyDeviceError, raised_from
from gpuworkers.weights import WeightsUnavailableError
from tasks import heartbeat, preload, slot_metrics  # noqa: F401  (connect the slot's heartbeat, preloading and clock to its start)
from tasks.app import app
from tasks.shard_execution import execute_shard
from tasks.specs import ShardSpec
from tasks.storage import TransientStorageError

logger = logging.getLogger(__name__)

# A child process that exits with this code lost its GPU context; the pool starts a fresh one.
STICKY_DEVICE_EXIT_CODE = 70
# A child process that exits with this code was interrupted by its soft time limit.
INTERRUPTED_EXIT_CODE = 75  # EX_TEMPFAIL


@app.task(
    name="batchery.run_shard",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    # The store was unreachable for a moment (shard data, or a model's weights): the same message
    # runs again after a backoff.
    autoretry_for=(TransientStorageError, WeightsUnavailableError),
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=5,
)
def run_shard(self: Any, spec: dict[str, Any]) -> dict[str, Any]:
    worker = self.request.hostname or socket.gethostname()
    shard = ShardSpec.from_dict(spec)
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
