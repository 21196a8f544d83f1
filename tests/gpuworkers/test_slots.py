from __future__ import annotations

import pytest

from gpuworkers.launcher import worker_command, worker_env
from gpuworkers.slots import Gpu, gpu_class_of, plan_slots


def test_four_gpus_in_slots_of_two_consume_the_x2_queue_of_their_class() -> None:
    slots = plan_slots(gpus=[0, 1, 2, 3], gpus_per_worker=2, gpu_class="test")
    assert [(slot.cuda_visible_devices, slot.queue) for slot in slots] == [
        ("0,1", "gpu.test.x2"),
        ("2,3", "gpu.test.x2"),
    ]
    env = worker_env(slots[1], {"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["REMAP_SIGTERM"] == "SIGQUIT", "SIGTERM is a soft shutdown, bounded in time"
    command = worker_command(slots[1], app="tasks.app", hostname="h", loglevel="INFO")
    # Its class's queue, and its own, where the scheduler sends the shards of the adapters it holds.
    assert command[command.index("--queues") + 1] == "gpu.test.x2,gpu.test.x2.slot.slot1-test@h"
    assert env["BATCHERY_OWN_QUEUE"] == f"gpu.test.x2.slot.{env['BATCHERY_WORKER_NAME']}"
    assert command[command.index("--concurrency") + 1] == "1"
    assert command[command.index("--hostname") + 1] == "slot1-test@h"


def test_a_slot_runs_the_slot_app_without_django_even_where_the_launcher_has_django_settings() -> None:
    (slot,) = plan_slots(gpus=[], gpus_per_worker=1, gpu_class=None)
    env = worker_env(slot, {"PATH": "/bin", "DJANGO_SETTINGS_MODULE": "portal.settings"})
    assert "DJANGO_SETTINGS_MODULE" not in env, "Celery would set Django up in the slot"
    command = worker_command(slot, app="tasks.slot.app", hostname="h", loglevel="INFO")
    assert command[1:5] == ["-m", "tasks.slot.worker", "--app", "tasks.slot.app"]


def test_a_machine_without_gpus_gets_one_cpu_slot_with_a_thread_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    (slot,) = plan_slots(gpus=[], gpus_per_worker=1, gpu_class=None)
    assert (slot.queue, slot.cuda_visible_devices, slot.torch_threads) == ("gpu.cpu", "", 4)


def test_cpu_slots_split_the_cores_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    slots = plan_slots(gpus=[], gpus_per_worker=1, gpu_class=None, cpu_slots=2)
    assert [(slot.queue, slot.cuda_visible_devices, slot.torch_threads) for slot in slots] == [
        ("gpu.cpu", "", 1),
        ("gpu.cpu", "", 1),
    ]
    assert worker_env(slots[0], {})["BATCHERY_TORCH_THREADS"] == "1"


def test_gpus_that_do_not_divide_into_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="3 GPUs cannot be split into slots of 2"):
        plan_slots(gpus=[0, 1, 2], gpus_per_worker=2, gpu_class="test")


def test_the_class_of_a_gpu_comes_from_its_name_and_memory() -> None:
    assert gpu_class_of(Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=80 * 1024**3)) == "h100-80gb"
