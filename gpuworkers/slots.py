"""GPU discovery and slots: which devices a worker process gets, and which queue it consumes.

Discovery goes through NVML (`nvidia-ml-py`) when it is installed and finds devices; otherwise the
host runs one `cpu` slot with a torch thread per core. `--cpu-slots N` splits the cores between N
slots instead, which is faster for small models: on two cores, two one-thread processes encode
~150 sentences/s and one two-thread process ~123 (`make bench` uses a slot per core).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpuworkers.nvml import nvml_session


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class Slot:
    """One worker process and the devices it owns."""

    index: int
    """Position of the slot on this host."""
    gpu_class: str
    """`cpu`, or a class such as `h100-80gb`."""
    gpus: tuple[int, ...]
    """Device indexes, exported as CUDA_VISIBLE_DEVICES; empty for a cpu slot."""
    torch_threads: int
    """Torch intra-op threads for the slot's process; 0 leaves torch's default."""

    @property
    def queue(self) -> str:
        if not self.gpus:
            return f"gpu.{self.gpu_class}"
        size = len(self.gpus)
        return f"gpu.{self.gpu_class}" if size == 1 else f"gpu.{self.gpu_class}.x{size}"

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(gpu) for gpu in self.gpus)


def discover_gpus() -> list[Gpu]:
    """GPUs that NVML reports; an empty list where NVML is missing or finds none."""
    with nvml_session() as pynvml:
        if pynvml is None:
            return []
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(Gpu(index=index, name=name if isinstance(name, str) else name.decode(), memory_bytes=memory))
        return gpus


def gpu_class_of(gpu: Gpu) -> str:
    """A class name from the device: `NVIDIA H100 80GB HBM3` becomes `h100-80gb`."""
    model = re.sub(r"^(nvidia|tesla)\s+", "", gpu.name.strip(), flags=re.IGNORECASE).split()[0].lower()
    memory_gb = round(gpu.memory_bytes / 1024**3)
    return f"{model}-{memory_gb}gb"


def plan_slots(
    *, gpus: list[int] | None, gpus_per_worker: int, gpu_class: str | None, cpu_slots: int | None = None
) -> list[Slot]:
    """Group GPUs into slots of `gpus_per_worker`; with no GPU, `cpu` slots of one thread each."""
    if gpus_per_worker not in (1, 2, 4, 8):
        raise ValueError(f"--gpus-per-worker must be 1, 2, 4 or 8, not {gpus_per_worker}")
    discovered = discover_gpus() if gpus is None else []
    indexes = gpus if gpus is not None else [gpu.index for gpu in discovered]
    if not indexes:
        count = cpu_slots or 1
        # Threads are set explicitly: slots left at torch's default each take every core and fight.
        threads = max(1, (os.cpu_count() or 1) // count)
        return [Slot(index=i, gpu_class=gpu_class or "cpu", gpus=(), torch_threads=threads) for i in range(count)]
    if len(indexes) % gpus_per_worker:
        raise ValueError(f"{len(indexes)} GPUs cannot be split into slots of {gpus_per_worker}")
    name = gpu_class or (gpu_class_of(discovered[0]) if discovered else "gpu")
    return [
        Slot(index=n, gpu_class=name, gpus=tuple(indexes[start : start + gpus_per_worker]), torch_threads=0)
        for n, start in enumerate(range(0, len(indexes), gpus_per_worker))
    ]
