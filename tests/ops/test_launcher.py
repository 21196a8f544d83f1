"""The launcher on this CPU machine: slots pinned to GPU indexes, routing by size, heartbeats,
supervision and draining, with real worker processes and a Redis of its own."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import redis
from celery import Celery

from portal.jobs.models import Job
from tasks.shared.config import slot_own_queue
from tasks.shared.fleet import FLEET_INDEX_KEY
from tests.factories import GpuClassFactory, ModelFactory
from tests.ops.conftest import Launcher, wait_slots
from tests.support.chaos import ChaosStack, check_exactly_once, wait_for, write_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _app(stack: ChaosStack, patch: pytest.MonkeyPatch) -> Celery:
    # Celery prefers these variables over a URL given in code; point them at this stack's Redis.
    patch.setenv("CELERY_BROKER_URL", stack.broker_url)
    patch.setenv("CELERY_RESULT_BACKEND", stack.broker_url)
    return Celery(broker=stack.broker_url, backend=stack.broker_url)


def _slow_job_on_one_slot(
    stack: ChaosStack, launch: Callable[..., Launcher], tmp_path: Path, *, records: int, sleep_per_record: float
) -> tuple[Launcher, str, list[str]]:
    """One cpu slot under a launcher, and a job of shards of 20 slow records submitted to it."""
    ModelFactory(
        name="slow-echo", engine="python", task="classify", is_default=False,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": sleep_per_record, "time_limit_base_s": 10 + 20 * sleep_per_record},
    )  # fmt: skip
    launcher = launch("cpu", "--cpu-slots", "1")
    wait_slots(stack, 1)
    ids = write_records(tmp_path / "in.jsonl", [f"record {n}" for n in range(records)])
    return launcher, stack.submit(model="slow-echo", input_path=tmp_path / "in.jsonl", shard_size=20), ids


def test_slots_of_two_gpus_each_see_only_their_devices_and_consume_only_the_x2_queue(
    stack: ChaosStack, launch: Callable[..., Launcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    launch("x2", "--gpus", "0,1,2,3", "--gpus-per-worker", "2", "--gpu-class", "test")
    beats = wait_slots(stack, 2)
    assert sorted((beat["slot"], tuple(beat["gpus"]), beat["gpu_class"]) for beat in beats) == [
        ("0", (0, 1), "test"),
        ("1", (2, 3), "test"),
    ]
    app = _app(stack, monkeypatch)
    results = [app.send_task("batchery.slot_info", kwargs={"pause_s": 0.5}, queue="gpu.test.x2") for _ in range(8)]
    answers = [result.get(timeout=60) for result in results]
    seen = {(answer["hostname"].split("@")[0], answer["cuda_visible_devices"]) for answer in answers}
    assert seen == {("slot0-test", "0,1"), ("slot1-test", "2,3")}
    assert {answer["queue"] for answer in answers} == {"gpu.test.x2"}
    queues = app.control.inspect(timeout=2).active_queues() or {}
    slot_queues = {name: {q["name"] for q in qs} for name, qs in queues.items() if name.startswith("slot")}
    # Each slot also consumes its own queue, where the scheduler routes the shards of adapters it holds.
    assert slot_queues and all(
        names == {"gpu.test.x2", slot_own_queue("gpu.test.x2", name)} for name, names in slot_queues.items()
    )


def test_a_model_of_two_gpus_per_replica_never_runs_on_a_one_gpu_slot(
    stack: ChaosStack, launch: Callable[..., Launcher], tmp_path: Path
) -> None:
    ModelFactory(
        name="wide-echo", engine="python", task="classify", is_default=False, gpus_per_replica=2,
        gpu_class=GpuClassFactory(name="test"), source="tests.support.chaos_engines:echo_factory",
        default_params={"time_limit_base_s": 8},
    )  # fmt: skip
    narrow = launch("x1", "--gpus", "0,1", "--gpus-per-worker", "1", "--gpu-class", "test")
    wide = launch("x2", "--gpus", "2,3", "--gpus-per-worker", "2", "--gpu-class", "test")
    wait_slots(stack, 3)
    ids = write_records(tmp_path / "in.jsonl", [f"record {n}" for n in range(40)])
    job_id = stack.submit(model="wide-echo", input_path=tmp_path / "in.jsonl", shard_size=5)
    job = wait_for(lambda: (j := Job.objects.get(pk=job_id)).is_finished and j, timeout_s=90, what="job", stack=stack)
    check_exactly_once("2-GPU model with 1- and 2-GPU slots up", job, ids, 0)
    pids = set(job.shards.values_list("worker_pid", flat=True))
    assert pids <= wide.worker_pids()
    assert not pids & narrow.worker_pids()


def test_a_slot_killed_with_sigkill_is_restarted_and_its_shard_delivered_again(
    stack: ChaosStack, launch: Callable[..., Launcher], tmp_path: Path
) -> None:
    launcher, job_id, ids = _slow_job_on_one_slot(stack, launch, tmp_path, records=60, sleep_per_record=0.1)
    wait_for(lambda: Job.objects.get(pk=job_id).status == "running", timeout_s=60, what="running", stack=stack)
    time.sleep(1)
    (master,) = launcher.slot_masters()
    for process in [*master.children(recursive=True), master]:
        process.send_signal(signal.SIGKILL)
    wait_for(lambda: [p for p in launcher.slot_masters() if p.pid != master.pid], timeout_s=30, what="a restarted slot")
    job = wait_for(lambda: (j := Job.objects.get(pk=job_id)).is_finished and j, timeout_s=120, what="job", stack=stack)
    check_exactly_once("slot killed with SIGKILL", job, ids, 0)
    assert job.status == "succeeded"
    assert "exited with" in launcher.log_path.read_text()


def test_sigterm_during_a_shard_lets_it_finish_starts_no_other_and_the_launcher_exits_0(
    stack: ChaosStack, launch: Callable[..., Launcher], tmp_path: Path
) -> None:
    launcher, job_id, _ = _slow_job_on_one_slot(stack, launch, tmp_path, records=60, sleep_per_record=0.1)

    def started() -> list[Path]:
        job = Job.objects.get(pk=job_id)
        return [p for s in job.shards.all() for p in (Path(s.prefix_uri.removeprefix("file://")) / "started").glob("*")]

    wait_for(started, timeout_s=60, what="a shard to start", stack=stack)
    before = started()
    launcher.process.send_signal(signal.SIGTERM)
    assert launcher.process.wait(timeout=60) == 0
    shard_dir = before[0].parent.parent
    assert (shard_dir / "commit.json").exists(), "the running shard finished and committed"
    assert started() == before, "no other shard started"
    client = redis.Redis.from_url(stack.broker_url)
    wait_for(
        lambda: not list(client.scan_iter(match="batchery:fleet:*")) and not client.scard(FLEET_INDEX_KEY),
        timeout_s=10,
        what="the heartbeat and its place in the fleet's index to go",
    )


def test_a_second_sigint_stops_every_slot_at_once(
    stack: ChaosStack, launch: Callable[..., Launcher], tmp_path: Path
) -> None:
    launcher, job_id, _ = _slow_job_on_one_slot(stack, launch, tmp_path, records=20, sleep_per_record=1.0)
    wait_for(lambda: Job.objects.get(pk=job_id).status == "running", timeout_s=60, what="running", stack=stack)
    time.sleep(2)
    pids = launcher.worker_pids()
    launcher.process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    launcher.process.send_signal(signal.SIGINT)
    launcher.process.wait(timeout=10)
    wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids),
             timeout_s=10, what="every slot process to be gone")  # fmt: skip
