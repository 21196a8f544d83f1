"""Control tasks keep their database connection from one task to the next (`tasks.app`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from celery.fixups.django import DjangoWorkerFixup
from django.db import connection

from tasks.app import DB_REUSE_MAX_TASKS, app
from tasks.control.shard_done import shard_done


@pytest.mark.django_db(transaction=True)
def test_the_django_fixup_of_a_worker_leaves_the_connection_open_between_tasks() -> None:
    fixup = DjangoWorkerFixup(app)
    connection.ensure_connection()
    opened = connection.connection

    for _ in range(3):
        fixup.on_task_prerun(sender=shard_done)
        fixup.on_task_postrun(sender=shard_done)

    assert connection.connection is opened, "a new PostgreSQL connection (and backend) for every control task"
    assert fixup.db_reuse_max == DB_REUSE_MAX_TASKS


def test_control_tasks_keep_their_own_time_limit_under_a_short_shard_limit() -> None:
    """A site (the tests' stacks: 20 s) may give shards a short limit; planning a large input or merging its
    output takes longer, and was killed by it: the app's default limits are the shards'."""
    script = (
        "from tasks.app import app; import tasks.control.plan, tasks.control.merge, tasks.slot.run_shard; "
        "print(app.conf.task_soft_time_limit, app.conf.task_time_limit, "
        "app.tasks['batchery.plan_job'].soft_time_limit, app.tasks['batchery.merge_job'].time_limit, "
        "app.tasks['batchery.run_shard'].time_limit)"
    )
    env = {**os.environ, "BATCHERY_SHARD_TIME_LIMIT_S": "20", "BATCHERY_CONTROL_TIME_LIMIT_S": "900"}
    printed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert printed == ["10", "20", "840", "900", "20"]
