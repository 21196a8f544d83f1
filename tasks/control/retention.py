"""The retention sweep's task (celery beat, control queue): see `portal.jobs.services.retention`."""

from __future__ import annotations

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import RETENTION_TASK


@app.task(name=RETENTION_TASK, base=ControlTask)
def retention_sweep() -> dict[str, float]:
    from django.utils import timezone

    from portal.jobs.services.retention import jobs_prune

    return jobs_prune(now=timezone.now()).as_dict()
