"""The Celery app shared by the portal, the control worker and the GPU workers.

Importing it needs no Django. The control side (portal, control worker, beat, Flower) loads it as
it is, with every task; a GPU host's slots load `tasks.slot_app`, which registers the slot's tasks
alone, since the control tasks import Django and a GPU host has no database.
"""

from __future__ import annotations

from celery import Celery

from tasks import logging_setup  # noqa: F401  (json logs; each task's job on its records)
from tasks.config import celery_settings

SLOT_TASK_MODULES = ("tasks.run_shard", "tasks.diagnostics")
"""Tasks of GPU (and `cpu`) queues: no database, only the broker and the store."""
CONTROL_TASK_MODULES = (
    "tasks.plan",
    "tasks.merge",
    "tasks.shard_done",
    "tasks.reconcile",
    "tasks.validate_batch",
    "tasks.finalize_batch",
    "tasks.webhooks",
)
"""Tasks of the `control` queue, near the database (`tasks.control.ControlTask`)."""

app = Celery("batchery")
app.conf.update(celery_settings())
app.conf.include = [*SLOT_TASK_MODULES, *CONTROL_TASK_MODULES]
