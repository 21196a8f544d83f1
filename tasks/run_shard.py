"""The shard task: runs on a GPU (or `cpu`) queue, touches no database, returns a manifest."""

from __future__ import annotations

import socket
from typing import Any

from tasks.app import app
from tasks.shard_execution import execute_shard
from tasks.specs import ShardSpec
from tasks.storage import TransientStorageError


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
    return execute_shard(ShardSpec.from_dict(spec), worker=worker).to_dict()
