"""Starts a slot process's busy/idle clock with its pool child, and stops it with the child.

Only processes started by the launcher (which sets BATCHERY_SLOT) are slots; a plain worker's
clock would describe no slot.
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_process_init, worker_process_shutdown

from gpuworkers.metrics import start_slot_clock, stop_slot_clock
from gpuworkers.settings import slot_name


@worker_process_init.connect
def start_clock(**_: Any) -> None:
    if slot_name():
        start_slot_clock()


@worker_process_shutdown.connect
def stop_clock(**_: Any) -> None:
    if slot_name():
        stop_slot_clock()
