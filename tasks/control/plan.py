"""The planning task: cut a queued job's input into shards, each sent to run as soon as it is written."""

from __future__ import annotations

from typing import Any

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import PLAN_TASK


@app.task(name=PLAN_TASK, base=ControlTask, bind=True, fails_job_from=frozenset({"queued", "planning"}))
def plan_job(self: Any, job_id: str) -> None:
    from portal.execution.plan import job_plan

    job_plan(job_id=job_id, worker=f"{self.request.hostname}:{self.request.id}")
