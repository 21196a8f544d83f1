"""Work is sent by task name (`tasks.send`): a portal process loads no task code of either side."""

from __future__ import annotations

import os
import subprocess
import sys

from tasks.shared.config import REPO_DIR

# Every portal module a request, a management command or a periodic sweep may import.
PORTAL_PROCESS = """
import importlib, pkgutil, sys
import django
django.setup()
import portal.urls  # the views first, in the order a request loads them
import portal
for module in pkgutil.walk_packages(portal.__path__, "portal."):
    if ".migrations" not in module.name and ".management.commands" not in module.name:
        importlib.import_module(module.name)
loaded = sorted(name for name in sys.modules if name.startswith(("tasks.slot", "tasks.control")))
print(" ".join(loaded) or "none")
"""


def test_a_portal_process_loads_neither_the_slot_runtime_nor_the_control_tasks() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "portal.settings"}
    done = subprocess.run(
        [sys.executable, "-c", PORTAL_PROCESS], cwd=REPO_DIR, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "none", done.stdout


def test_plans_deliveries_and_validations_are_published_to_their_own_queues_not_control() -> None:
    """What Celery itself publishes (its `before_task_publish` signal names the routing key)."""
    from celery.signals import before_task_publish

    from tasks import send
    from tasks.app import app
    from tasks.shared.config import DELIVER_WEBHOOK_TASK, PLAN_TASK, VALIDATE_BATCH_TASK, WEBHOOKS_SWEEP_TASK

    published: dict[str, str] = {}

    def seen(sender: str, routing_key: str, **_: object) -> None:
        published[sender] = routing_key

    before_task_publish.connect(seen)
    try:
        # Ids of nothing: a worker that takes them finds nothing to do.
        send.send_webhook_delivery(-1)
        send.send_batch_validation("batch_none", task_id="validate-batch_none-test")
        send.send_plan("00000000-0000-0000-0000-000000000000", task_id="plan-nothing-test")
        app.send_task(WEBHOOKS_SWEEP_TASK, expires=1)
    finally:
        before_task_publish.disconnect(seen)
    assert published == {
        DELIVER_WEBHOOK_TASK: "webhooks",
        VALIDATE_BATCH_TASK: "validation",
        PLAN_TASK: "planning",
        WEBHOOKS_SWEEP_TASK: "webhooks",
    }
