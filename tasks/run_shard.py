"""The shard task: runs on a GPU (or `cpu`) queue, touches no database, returns a manifest.

Its message is acknowledged only after it ran. A worker that dies mid-shard and a soft time limit
put the message back on the queue; a hard time limit records a failure that the merge sends again.
The attempt count kept in storage bounds how often either happens (see `tasks.shard_bisect`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from celery.exceptions import Reject, SoftTimeLimitExceeded

from gpuworkers.faults import StickyDeviceError
from tasks import heartbeat, preload, slot_metrics  # noqa: F401  (connect the slot's heartbeat, preloading and clock to its start)
from tasks.app import app
from tasks.shard_execution import execute_shard
from tasks.specs import ShardSpec
from tasks.storage import TransientStorageError

logger = logging.getLogger(__name__)

# A child process that exits with this code lost its GPU context; the pool starts a fresh one.
STICKY_DEVICE_EXIT_CODE = 70


@app.task(
    name="batchery.run_shard",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(TransientStorageError,),
    retry_backoff=True,
    retry_backoff_max=60,
    max_retries=5,
)
def run_shard(self: Any, spec: dict[str, Any]) -> dict[str, Any]:
    worker = self.request.hostname or socket.gethostname()
    shard = ShardSpec.from_dict(spec)
    try:
        return execute_shard(shard, worker=worker).to_dict()
    except SoftTimeLimitExceeded:
        raise Reject(f"shard {shard.job_id}/{shard.shard_index} passed its soft time limit", requeue=True) from None
    except StickyDeviceError:
        # The CUDA context is unusable for every later shard in this process: leave, and let the
        # pool start a fresh process; the message goes back to the queue as for a lost worker.
        logger.exception("shard %s/%d hit a sticky device error; exiting", shard.job_id, shard.shard_index)
        os._exit(STICKY_DEVICE_EXIT_CODE)
