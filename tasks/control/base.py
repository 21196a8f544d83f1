"""The base class of control tasks: Django set up at the first call, stale database connections
dropped around each call, a database, Redis or broker that restarts waited for, and a job failed
(from the statuses its task names) when its task fails for good. A failure whose exception says
`fails_no_job` (work shared by several jobs) fails none.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import redis
from celery import Task
from django.db import InterfaceError, OperationalError
from kombu.exceptions import OperationalError as BrokerError

from tasks.shared.config import CONTROL_HARD_TIME_LIMIT_S, CONTROL_SOFT_TIME_LIMIT_S

logger = logging.getLogger("batchery.control")


def ensure_django() -> None:
    import django
    from django.apps import apps

    if not apps.ready:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
        django.setup()


class ControlTask(Task):
    acks_late = True
    reject_on_worker_lost = True
    # A database, Redis or broker that is restarting comes back: wait for it rather than fail the job.
    # (Where the retry cannot be sent, the broker being down, Celery drops the message and the
    # reconciler's sweep does the task's work.)
    autoretry_for = (OperationalError, InterfaceError, redis.ConnectionError, redis.TimeoutError, BrokerError)
    retry_backoff = 2
    retry_backoff_max = 60
    max_retries = 30
    # Over the app's defaults, which are the shards' limits (`tasks.shared.config`).
    time_limit = CONTROL_HARD_TIME_LIMIT_S
    soft_time_limit = CONTROL_SOFT_TIME_LIMIT_S
    #: Statuses from which a failure of this task fails the job; others are left to their owner.
    fails_job_from: frozenset[str] = frozenset()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ensure_django()
        from django.db import close_old_connections

        # Like Django's request cycle: drop connections that went stale while the worker idled.
        close_old_connections()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            close_old_connections()

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        # Every control task takes the job id first; a job must never be left without an ending.
        logger.error("control task %s[%s] failed: %r args=%r", self.name, task_id, exc, args)
        # Work shared with other jobs (a batch of several jobs' shard endings): no one job is to blame.
        if getattr(exc, "fails_no_job", False):
            return
        job_id = kwargs.get("job_id") or (args[0] if args else None)
        if job_id is None or not self.fails_job_from:
            return
        from portal.jobs.transitions import job_fail

        job_fail(
            job_id=str(job_id), reason=f"{self.name} failed: {type(exc).__name__}: {exc}", source=self.fails_job_from
        )
