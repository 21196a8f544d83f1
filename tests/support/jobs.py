"""Helpers to wait for and read jobs in pipeline tests."""

from __future__ import annotations

import json
import time
from typing import Any

from portal.jobs.models import Job
from tasks.storage import store_for


def wait_for_job(job: Job, *, timeout_s: float = 180.0, workers: dict[str, Any] | None = None) -> Job:
    """Poll the database until the job ends; on timeout, fail with the workers' logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.is_finished:
            return job
        time.sleep(0.25)
    logs = "\n".join(f"--- {name}\n{w.log_tail()}" for name, w in (workers or {}).items())
    raise AssertionError(f"job {job.id} still {job.status} after {timeout_s}s\n{logs}")


def read_lines(uri: str) -> list[dict[str, Any]]:
    with store_for(uri).open_read(uri) as stream:
        return [json.loads(line) for line in stream]
