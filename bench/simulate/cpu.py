"""CPU seconds of the simulation's processes and of the machine, read with psutil."""

from __future__ import annotations

import psutil

from bench.py_spy import cpu_seconds_of


def cpu_spent(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds between two readings, by name: a process that started meanwhile counts from 0."""
    return {
        name: sum(seconds - before.get(name, {}).get(pid, 0.0) for pid, seconds in pids.items())
        for name, pids in after.items()
    }


MACHINE = "machine, every process"


def machine_busy() -> float:
    """CPU seconds the machine's cores spent on anything but idling or waiting for I/O (guest time is in
    user time already)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + getattr(times, "irq", 0.0) + getattr(times, "softirq", 0.0)


def tree_cpu(pid: int) -> dict[int, float]:
    try:
        root = psutil.Process(pid)
        return {process.pid: cpu_seconds_of(process) for process in [root, *root.children(recursive=True)]}
    except psutil.Error:
        return {}
