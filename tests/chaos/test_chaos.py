"""The chaos suite: real jobs through a real stack while processes die, pause and lose messages.

Every scenario ends with the same checker (`check_exactly_once`): output and errors together hold the input
ids, each exactly once, in input order; one manifest per shard; one terminal transition.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from portal.jobs.models import Job
from tests.chaos.conftest import scale
from tests.factories import ModelFactory
from tests.support.chaos import (
    ChaosStack,
    check_exactly_once,
    commits,
    last_window_running,
    read_jsonl,
    shards_started,
    wait_for,
    write_records,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(300)]


def _texts(count: int, marker: dict[int, str] | None = None) -> list[str]:
    marker = marker or {}
    return [f"record {n} {marker.get(n, '')}".strip() for n in range(count)]


def _wait_end(stack: ChaosStack, job_id: str, timeout_s: float = 180) -> Job:
    def ended() -> Job | None:
        job = Job.objects.get(pk=job_id)
        return job if job.is_finished else None

    job: Job = wait_for(ended, timeout_s=timeout_s, what=f"job {job_id} to end", stack=stack)
    return job


def _run(
    stack: ChaosStack,
    tmp_path: Path,
    *,
    scenario: str,
    model: str,
    texts: list[str],
    shard_size: int,
    report: Callable[[Any], None],
    during: Callable[[str], None] | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[Job, Any]:
    ids = write_records(tmp_path / f"{scenario}.jsonl", texts)
    started = time.monotonic()
    job_id = stack.submit(model=model, input_path=tmp_path / f"{scenario}.jsonl", shard_size=shard_size, extra=extra)
    if during is not None:
        during(job_id)
    job = _wait_end(stack, job_id)
    result = check_exactly_once(scenario, job, ids, time.monotonic() - started)
    report(result)
    return job, result


def test_a_worker_killed_mid_shard_loses_nothing(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("echo", sleep_per_record=0.02)

    def kill_mid_shard(job_id: str) -> None:
        wait_for(shards_started(job_id, 2), timeout_s=60, what="two shards to start", stack=chaos_stack)
        for child in chaos_stack.pool_children("cpu0"):
            os.kill(child.pid, signal.SIGKILL)

    job, _ = _run(
        chaos_stack, tmp_path, scenario="kill -9 a shard's worker", model="chaos-echo", texts=_texts(scale(200, 2000)),
        shard_size=25, report=chaos_report, during=kill_mid_shard,
    )  # fmt: skip
    assert job.status == "succeeded"


def test_a_poison_record_is_isolated_with_bounded_attempts(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("poison", micro_batch_size=4)
    count = scale(48, 400)
    job, result = _run(
        chaos_stack, tmp_path, scenario="poison record (os.abort)", model="chaos-poison",
        texts=_texts(count, {count // 3: "POISON"}), shard_size=16, report=chaos_report,
    )  # fmt: skip
    assert job.status == "partially_succeeded"
    assert result.error_codes == {"poison_record": 1}
    poisoned = next(s for s in job.shards.all() if s.failed_records)
    started = Path(poisoned.prefix_uri.removeprefix("file://")) / "started"
    # 2 plain attempts, then checkpointed ones: a range of 4 halves twice, then the record is given up.
    assert len(list(started.iterdir())) <= 2 + 4


def test_out_of_memory_above_a_size_splits_batches_and_labels_only_the_oversized_record(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("oom", oom_above_chars=60, micro_batch_size=8)
    texts = _texts(scale(64, 640))
    texts[5] = "x" * 100
    job, result = _run(
        chaos_stack, tmp_path, scenario="CUDA-style OOM above a size", model="chaos-oom", texts=texts,
        shard_size=16, report=chaos_report,
    )  # fmt: skip
    assert result.error_codes == {"out_of_memory": 1}
    assert job.failed_records == 1


def test_a_shard_that_hangs_is_killed_at_its_hard_limit_and_the_job_completes(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("hang", micro_batch_size=2, time_limit_base_s=3, time_limit_per_record_s=0)
    job, result = _run(
        chaos_stack, tmp_path, scenario="hang in a blocking call", model="chaos-hang",
        texts=_texts(12, {7: "HANG"}), shard_size=4, report=chaos_report,
    )  # fmt: skip
    assert job.status == "partially_succeeded", job.error
    assert result.error_codes == {"poison_record": 1}


def test_a_soft_time_limit_inside_a_slow_import_replaces_the_process_and_the_shard_runs_again(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    # The limit strikes while the model's module is half-imported; that process could never import
    # it again (as with a half-imported torch), so a fresh process must take the shard.
    marker = tmp_path / "first-import"
    chaos_model(
        "fragile_import", load_params={"first_import_marker": str(marker)}, time_limit_base_s=3,
        time_limit_per_record_s=0,
    )  # fmt: skip
    pids_before = {child.pid for child in chaos_stack.pool_children("cpu0")}
    job, _ = _run(
        chaos_stack, tmp_path, scenario="soft time limit inside a slow import", model="chaos-fragile_import",
        texts=_texts(8), shard_size=4, report=chaos_report,
    )  # fmt: skip
    assert marker.exists(), "the first import was the slow one"
    assert job.status == "succeeded", job.error
    assert not pids_before & {child.pid for child in chaos_stack.pool_children("cpu0")}, "a fresh process took over"


def test_a_shard_message_delivered_twice_is_merged_once(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("echo", sleep_per_record=0.01)

    def republish(job_id: str) -> None:
        wait_for(shards_started(job_id, 1), timeout_s=60, what="a shard to start", stack=chaos_stack)
        from portal.execution.dispatch import shard_spec

        job = Job.objects.select_related("model").get(pk=job_id)
        shard = job.shards.order_by("index").first()
        assert shard is not None
        _publish(chaos_stack, "batchery.run_shard", [shard_spec(job, shard).to_dict()], "gpu.cpu", times=2)

    job, _ = _run(
        chaos_stack, tmp_path, scenario="shard message delivered twice", model="chaos-echo",
        texts=_texts(scale(100, 1000)), shard_size=20, report=chaos_report, during=republish,
    )  # fmt: skip
    assert job.status == "succeeded"


def test_a_lost_merge_callback_is_replaced_by_the_reconciler(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    # Shards of half a second: the job's last window is still running when the control worker stops.
    chaos_model("echo", sleep_per_record=0.05)

    def drop_callback(job_id: str) -> None:
        # Only once every shard is sent: the scheduler's window holds a few shards a slot, and the rest
        # would wait for the control workers that are about to stop (all of them: any would take the callbacks).
        wait_for(last_window_running(job_id), timeout_s=scale(60, 300), what="every shard sent", stack=chaos_stack)
        chaos_stack.stop_control()
        committed = commits(job_id)
        wait_for(lambda: committed() == Job.objects.get(pk=job_id).shard_count, timeout_s=60, what="all commits")
        import redis

        client = redis.Redis.from_url(chaos_stack.broker_url)
        dropped = client.delete("control")
        assert dropped == 1, "the chord callbacks were waiting in the control queue"
        chaos_stack.start_control()

    job, _ = _run(
        chaos_stack, tmp_path, scenario="merge callback lost", model="chaos-echo", texts=_texts(scale(60, 600)),
        shard_size=10, report=chaos_report, during=drop_callback,
    )  # fmt: skip
    assert job.status == "succeeded"


def test_redis_restarted_empty_mid_job_delays_the_job_but_loses_nothing(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("echo", sleep_per_record=0.02)

    def restart_redis(job_id: str) -> None:
        wait_for(shards_started(job_id, 2), timeout_s=60, what="two shards to start", stack=chaos_stack)
        chaos_stack.restart_redis_empty()

    job, _ = _run(
        chaos_stack, tmp_path, scenario="Redis restarted empty", model="chaos-echo", texts=_texts(scale(200, 2000)),
        shard_size=25, report=chaos_report, during=restart_redis,
    )  # fmt: skip
    assert job.status == "succeeded"


def test_a_deadline_expires_the_job_keeping_what_finished(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("echo", sleep_per_record=0.1)
    deadline = scale(6, 30)
    job, result = _run(
        chaos_stack, tmp_path, scenario=f"{deadline}-second deadline, slow model", model="chaos-echo",
        texts=_texts(deadline * 20), shard_size=10, report=chaos_report, extra=("--deadline", str(deadline)),
    )  # fmt: skip
    assert job.status == "expired"
    assert set(result.error_codes) == {"expired"}
    assert 0 < job.succeeded_records < result.records_in


def test_cancel_mid_run_ends_the_job_within_seconds_and_starts_no_shard_after_it(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("echo", sleep_per_record=0.05)
    moments: dict[str, float] = {}

    def cancel(job_id: str) -> None:
        wait_for(shards_started(job_id, 2), timeout_s=60, what="two shards to start", stack=chaos_stack)
        moments["asked"] = time.time()
        chaos_stack.manage("job", "cancel", job_id)
        wait_for(lambda: Job.objects.get(pk=job_id).status == "cancelled", timeout_s=10, what="cancelled")
        moments["ended"] = time.time()

    job, result = _run(
        chaos_stack, tmp_path, scenario="cancel mid-run", model="chaos-echo", texts=_texts(scale(200, 1000)),
        shard_size=10, report=chaos_report, during=cancel,
    )  # fmt: skip
    assert job.status == "cancelled"
    assert moments["ended"] - moments["asked"] < 10
    assert set(result.error_codes) == {"cancelled"}
    time.sleep(2)
    late = [
        marker
        for shard in job.shards.all()
        for marker in (Path(shard.prefix_uri.removeprefix("file://")) / "started").glob("*")
        if marker.stat().st_mtime > moments["ended"]
    ]
    assert late == [], "no shard attempt started after the job was cancelled"


@pytest.mark.parametrize("records", [0, 1])
def test_jobs_of_zero_and_one_record_complete(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path, records: int
) -> None:
    chaos_model("echo")
    job, _ = _run(
        chaos_stack, tmp_path, scenario=f"job of {records} record{'s' if records != 1 else ''}", model="chaos-echo",
        texts=_texts(records), shard_size=10, report=chaos_report,
    )  # fmt: skip
    assert job.status == "succeeded"
    assert job.shard_count == records


def test_a_job_of_many_shards_completes(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("echo")
    shards = scale(200, 2000)
    job, _ = _run(
        chaos_stack, tmp_path, scenario=f"job of {shards} shards", model="chaos-echo", texts=_texts(shards),
        shard_size=1, report=chaos_report,
    )  # fmt: skip
    assert job.status == "succeeded"
    assert job.shard_count == shards


def _publish(stack: ChaosStack, task: str, args: list[Any], queue: str, *, times: int) -> None:
    from kombu import Connection

    from tasks.app import app

    with Connection(stack.broker_url) as connection:
        for _ in range(times):
            app.send_task(task, args=args, queue=queue, connection=connection)


def test_a_paused_worker_that_wakes_after_another_attempt_committed_changes_no_byte(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    import redis

    from tests.chaos.conftest import wait_consuming

    chaos_model("echo", sleep_per_record=0.05)
    chaos_stack.start_shard_worker("cpu1")
    wait_consuming(chaos_stack)
    texts = _texts(scale(80, 400))
    baseline, _ = _run(
        chaos_stack, tmp_path, scenario="fault-free baseline", model="chaos-echo", texts=texts, shard_size=20,
        report=lambda result: None,
    )  # fmt: skip
    client = redis.Redis.from_url(chaos_stack.broker_url)
    paused: dict[str, Any] = {}

    def pause_then_wake(job_id: str) -> None:
        def held_by_cpu0() -> str | None:
            for key in client.scan_iter(match=f"batchery:lease:shard:{job_id}:*"):
                if (client.get(key) or b"").startswith(b"cpu0@"):
                    return key.decode().rsplit(":", 1)[-1]
            return None

        index = wait_for(held_by_cpu0, timeout_s=60, what="cpu0 to hold a shard", stack=chaos_stack)
        # The whole worker pauses, pool and master: a master left running would kill its paused
        # child at the hard time limit, which is a different fault (see the hang scenario).
        master = psutil.Process(chaos_stack.workers["cpu0"].process.pid)
        paused["processes"] = [master, *master.children(recursive=True)]
        for process in paused["processes"]:
            process.send_signal(signal.SIGSTOP)
        shard = Job.objects.get(pk=job_id).shards.get(index=int(index))
        commit = Path(shard.prefix_uri.removeprefix("file://")) / "commit.json"
        # Past the visibility timeout the broker hands the shard to cpu1, which commits it.
        wait_for(commit.exists, timeout_s=90, what="another attempt to commit the paused shard", stack=chaos_stack)
        paused["committed_by"] = json.loads(commit.read_text())["worker"]
        for process in paused["processes"]:
            process.send_signal(signal.SIGCONT)

    job, _ = _run(
        chaos_stack, tmp_path, scenario="worker paused past the visibility timeout", model="chaos-echo", texts=texts,
        shard_size=20, report=chaos_report, during=pause_then_wake,
    )  # fmt: skip
    assert paused["committed_by"].startswith("cpu1@")
    assert job.status == "succeeded"
    assert (
        Path(job.output_uri.removeprefix("file://")).read_bytes()
        == Path(baseline.output_uri.removeprefix("file://")).read_bytes()
    )


def test_retry_reruns_only_the_failed_records_into_the_same_output(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    fixed = tmp_path / "dependency-is-back"
    chaos_model("flaky", fixed_when_exists=str(fixed))
    count = scale(60, 600)
    flaky = {n: "FLAKY" for n in range(3, count, 7)}
    job, result = _run(
        chaos_stack, tmp_path, scenario="first run, flaky dependency down", model="chaos-flaky",
        texts=_texts(count, flaky), shard_size=10, report=lambda result: None,
    )  # fmt: skip
    assert job.status == "partially_succeeded"
    assert result.errors == len(flaky)
    first_output = read_jsonl(job.output_uri)

    fixed.touch()
    started = time.monotonic()
    chaos_stack.manage("job", "retry", str(job.id))
    job = _wait_end(chaos_stack, str(job.id))
    retried = check_exactly_once(
        "retry failed only", job, [f"rec-{n:06d}" for n in range(count)], time.monotonic() - started
    )
    chaos_report(retried)
    assert job.status == "succeeded"
    assert job.retry_round == 1
    assert sum(job.shards.filter(round=1).values_list("record_count", flat=True)) == len(flaky)
    output = read_jsonl(job.output_uri)
    assert [line for n, line in enumerate(output) if n not in flaky] == [
        line for n, line in enumerate(first_output) if n not in flaky
    ]
    assert all("response" in output[n] for n in flaky)


def test_a_sticky_device_error_replaces_the_worker_process_and_the_record_ends_as_poison(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    chaos_model("sticky", micro_batch_size=4)
    pids_before = {child.pid for child in chaos_stack.pool_children("cpu0")}
    job, result = _run(
        chaos_stack, tmp_path, scenario="sticky CUDA error", model="chaos-sticky",
        texts=_texts(32, {9: "STICKY"}), shard_size=8, report=chaos_report,
    )  # fmt: skip
    assert job.status == "partially_succeeded"
    assert result.error_codes == {"poison_record": 1}
    assert not pids_before & {child.pid for child in chaos_stack.pool_children("cpu0")}, "a fresh process took over"


def test_a_model_that_will_not_load_fails_the_slot_start_not_the_shards(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    from portal.catalog.services import catalog_publish
    from tests.chaos.conftest import wait_consuming

    chaos_model("echo")
    ModelFactory(
        name="chaos-unloadable", engine="python", task="classify", is_default=False,
        source="tests.support.chaos_engines:no_such_factory",
    )  # fmt: skip
    catalog_publish()
    chaos_stack.workers.pop("cpu0").stop()
    broken = chaos_stack.start_shard_worker("cpu-broken", preload="chaos-unloadable")
    wait_for(lambda: broken.process.poll() is not None, timeout_s=60, what="the broken slot to stop", stack=chaos_stack)
    assert "cannot preload model chaos-unloadable" in broken.log_path.read_text()
    del chaos_stack.workers["cpu-broken"]

    healthy = chaos_stack.start_shard_worker("cpu-preloaded", preload="chaos-echo")
    wait_consuming(chaos_stack)
    job, _ = _run(
        chaos_stack, tmp_path, scenario="unloadable model on one slot", model="chaos-echo", texts=_texts(40),
        shard_size=10, report=chaos_report,
    )  # fmt: skip
    assert job.status == "succeeded"
    assert all(shard.cache_hit for shard in job.shards.all()), "the healthy slot had the model loaded before work"
    assert all(shard.load_seconds == 0 for shard in job.shards.all())
    assert healthy.process.poll() is None


def test_a_slot_preloading_a_model_slower_than_celerys_process_start_timeout_starts_and_serves(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    from portal.catalog.services import catalog_publish
    from tests.chaos.conftest import wait_consuming

    # Celery kills a pool process not up within 4 s of its start by default (the first processes
    # excepted); real weights take longer, and a process that replaces a lost one loads them again.
    chaos_model("slow_load", load_params={"load_seconds": 6})
    catalog_publish()
    chaos_stack.workers.pop("cpu0").stop()
    # Worker logs are appended to; read only this run's part.
    log_path = chaos_stack.log_dir / "cpu-slow-preload.log"
    log_start = log_path.stat().st_size if log_path.exists() else 0

    def log() -> str:
        return log_path.read_bytes()[log_start:].decode(errors="replace")

    chaos_stack.start_shard_worker("cpu-slow-preload", preload="chaos-slow_load")

    wait_consuming(chaos_stack)
    wait_for(
        lambda: "preloaded model chaos-slow_load" in log(), timeout_s=60, what="the first process to preload",
        stack=chaos_stack,
    )  # fmt: skip
    for child in chaos_stack.pool_children("cpu-slow-preload"):
        os.kill(child.pid, signal.SIGKILL)
    job, _ = _run(
        chaos_stack, tmp_path, scenario="preload slower than Celery's process start", model="chaos-slow_load",
        texts=_texts(8), shard_size=4, report=chaos_report,
    )  # fmt: skip
    assert job.status == "succeeded", job.error
    assert all(shard.cache_hit for shard in job.shards.all()), "the preloaded process ran every shard"
    assert "Timed out waiting for UP message" not in log()


def test_sigterm_gives_the_running_shard_its_soft_shutdown_time_then_the_shard_runs_elsewhere(
    chaos_stack: ChaosStack, chaos_model: Any, chaos_report: Any, tmp_path: Path
) -> None:
    from tests.chaos.conftest import wait_consuming

    chaos_model("echo", sleep_per_record=0.2)
    chaos_stack.workers.pop("cpu0").stop()
    # As the launcher starts its slots: SIGTERM is Celery's soft shutdown, here 2 seconds long.
    soft = {"REMAP_SIGTERM": "SIGQUIT", "BATCHERY_SOFT_SHUTDOWN_S": "2"}
    slot = chaos_stack.start_shard_worker("slot0", extra_env=soft)
    wait_consuming(chaos_stack)
    timing: dict[str, float] = {}

    def terminate_mid_shard(job_id: str) -> None:
        wait_for(shards_started(job_id, 1), timeout_s=60, what="a shard to start", stack=chaos_stack)
        timing["sent"] = time.monotonic()
        slot.process.send_signal(signal.SIGTERM)
        slot.process.wait(timeout=30)
        timing["exited"] = time.monotonic()
        del chaos_stack.workers["slot0"]
        chaos_stack.start_shard_worker("slot1", extra_env=soft)

    job, _ = _run(
        chaos_stack, tmp_path, scenario="SIGTERM mid-shard (soft shutdown)", model="chaos-echo", texts=_texts(60),
        shard_size=20, report=chaos_report, during=terminate_mid_shard,
    )  # fmt: skip
    assert job.status == "succeeded"
    assert timing["exited"] - timing["sent"] < 10, "the soft shutdown is bounded, not a wait for the whole shard"
    assert {shard.worker.split("@")[0] for shard in job.shards.all()} == {"slot1"}
