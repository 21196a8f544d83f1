"""The periodic reconciler task (celery beat, control queue): see `portal.execution.reconcile`."""

from __future__ import annotations

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import RECONCILE_TASK


@app.task(name=RECONCILE_TASK, base=ControlTask)
def reconcile() -> dict[str, int]:
    from portal.execution.reconcile import jobs_reconcile

    return jobs_reconcile().as_dict()
