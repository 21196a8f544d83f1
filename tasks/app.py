"""The Celery app shared by the portal, the control worker and the GPU workers.

Importing it needs no Django. The control side (portal, control worker, beat, Flower) loads it as
it is, with every task; a GPU host's slots load `tasks.slot.app`, which registers the slot's tasks
alone, since the control tasks import Django and a GPU host has no database.
"""

from __future__ import annotations

from celery import Celery

from tasks.shared import logging_setup  # noqa: F401  (json logs; each task's job on its records)
from tasks.shared.broker_transport import register_broker_transport
from tasks.shared.config import celery_settings

SLOT_TASK_MODULES = ("tasks.slot.run_shard", "tasks.slot.diagnostics")
"""Tasks of GPU (and `cpu`) queues: no database, only the broker and the store."""
CONTROL_TASK_MODULES = (
    "tasks.control.plan",
    "tasks.control.compare",
    "tasks.control.merge",
    "tasks.control.shard_done",
    "tasks.control.reconcile",
    "tasks.control.retention",
    "tasks.control.validate_batch",
    "tasks.control.finalize_batch",
    "tasks.control.webhooks",
)
"""Tasks near the database (`tasks.control.base.ControlTask`): of the `control` queue, and of the
`webhooks` and `validation` queues that their own workers consume (`tasks.shared.config.TASK_QUEUES`)."""

DB_REUSE_MAX_TASKS = 1000
"""Tasks a worker process runs on one database connection before Celery's Django fixup closes it."""

register_broker_transport()
app = Celery("batchery")
app.conf.update(celery_settings())
# Unless told otherwise, Celery's Django fixup closes the database connection before and after every
# task: each control task would open a new PostgreSQL connection and run its queries on a cold server
# backend, a large share of a small job's latency. `ControlTask` drops stale connections itself, as
# CONN_MAX_AGE and CONN_HEALTH_CHECKS say.
app.conf.update({"CELERY_DB_REUSE_MAX": DB_REUSE_MAX_TASKS})
app.conf.include = [*SLOT_TASK_MODULES, *CONTROL_TASK_MODULES]
