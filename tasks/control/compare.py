"""The comparison task: a re-run that has ended has its comparison report written at once, so that the
first to ask for it reads a file; a message lost costs nothing more, since the first read writes it."""

from __future__ import annotations

from typing import Any

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import COMPARE_TASK


@app.task(name=COMPARE_TASK, base=ControlTask, bind=True)
def compare_rerun(self: Any, job_id: str) -> None:
    from portal.jobs.services.comparison import job_comparison_write

    job_comparison_write(job_id=job_id, worker=self.request.hostname or "compare")
