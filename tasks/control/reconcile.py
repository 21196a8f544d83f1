"""The periodic sweep's task (celery beat, control queue): see `portal.ops.periodic`."""

from __future__ import annotations

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import RECONCILE_TASK


@app.task(name=RECONCILE_TASK, base=ControlTask)
def reconcile() -> dict[str, int]:
    from portal.ops.periodic import periodic_sweep

    return periodic_sweep()
