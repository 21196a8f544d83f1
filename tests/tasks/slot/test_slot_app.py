"""The slot's Celery app: the shard task and the slot diagnostics, in a process where Django cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.workers import REPO

# What `python -m tasks.slot.worker --app tasks.slot.app worker` loads before its first task.
SLOT_PROCESS = """
import json, sys
from tasks.slot.worker import RefuseDjango
sys.meta_path.insert(0, RefuseDjango())
from tasks.slot.app import app
app.loader.import_default_modules()
try:
    import tasks.control.plan
    control = "imported"
except ModuleNotFoundError as exc:
    control = str(exc)
print(json.dumps({
    "tasks": sorted(name for name in app.tasks if name.startswith("batchery.")),
    "django": "django" in sys.modules,
    "control": control,
}))
"""


def test_the_slot_app_registers_the_slot_tasks_alone_and_a_control_module_cannot_load() -> None:
    env = {"PATH": "/usr/bin:/bin", "CELERY_BROKER_URL": "redis://127.0.0.1:9/0"}
    finished = subprocess.run(
        [sys.executable, "-c", SLOT_PROCESS], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert finished.returncode == 0, finished.stderr
    seen = json.loads(finished.stdout.splitlines()[-1])
    assert seen["tasks"] == ["batchery.run_shard", "batchery.run_shards", "batchery.slot_info"]
    assert seen["django"] is False
    assert "a GPU host's slot runs without Django" in seen["control"]
