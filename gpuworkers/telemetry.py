"""GPU telemetry for heartbeats: utilization and memory of a slot's devices, where NVML has them."""

from __future__ import annotations

from typing import Any

from gpuworkers.nvml import nvml_session


def gpu_telemetry(indexes: list[int]) -> list[dict[str, Any]]:
    """One entry per device index: utilization (%) and memory (bytes); empty without NVML or GPUs."""
    if not indexes:
        return []
    with nvml_session() as pynvml:
        if pynvml is None:
            return []
        try:
            readings = []
            for index in indexes:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                readings.append(
                    {
                        "gpu": index,
                        "utilization": utilization.gpu,
                        "memory_used": memory.used,
                        "memory_total": memory.total,
                    }
                )
            return readings
        except pynvml.NVMLError:
            return []
