"""The Celery application shared by the portal, the control worker and the GPU workers.

Importing it needs no Django: GPU workers load only `tasks.run_shard`; control tasks set Django up
on first use (`tasks.control.ControlTask`).
"""

from __future__ import annotations

from celery import Celery

from tasks import logging_setup  # noqa: F401  (json logs; each task's job on its records)
from tasks.config import celery_settings

app = Celery("batchery")
app.conf.update(celery_settings())
app.conf.include = [
    "tasks.plan",
    "tasks.run_shard",
    "tasks.merge",
    "tasks.shard_done",
    "tasks.reconcile",
    "tasks.diagnostics",
    "tasks.finalize_batch",
]
