"""`batchery.slot_info`: what a slot's worker process sees (devices, hostname, Django loaded or not), for operators
and tests."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from gpuworkers.settings import slot_name
from tasks.app import app
from tasks.shared.config import SLOT_INFO_TASK


@app.task(name=SLOT_INFO_TASK, bind=True)
def slot_info(self: Any, pause_s: float = 0.0) -> dict[str, Any]:
    # A pause keeps the slot busy, so that several calls spread over several slots.
    time.sleep(pause_s)
    return {
        "hostname": self.request.hostname,
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slot": slot_name() or None,
        "queue": (self.request.delivery_info or {}).get("routing_key"),
        # A GPU host imports no Django (`tasks.slot.worker`); this shows it from the slot itself.
        "django_imported": "django" in sys.modules,
    }
