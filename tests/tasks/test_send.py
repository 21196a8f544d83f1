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
