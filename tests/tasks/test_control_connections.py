"""Control tasks keep their database connection from one task to the next (`tasks.app`)."""

from __future__ import annotations

import pytest
from celery.fixups.django import DjangoWorkerFixup
from django.db import connection

from tasks.app import DB_REUSE_MAX_TASKS, app
from tasks.shard_done import shard_done


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
