"""A wave's message (`run_shards`): its shards run one after another with the real bundled model; what
settling reads of a shard that did not commit is stored in the real result backend under its own task id."""

from __future__ import annotations

import json
import signal
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from celery import states
from celery.exceptions import SoftTimeLimitExceeded

from tasks.app import app
from tasks.shared.specs import ShardSpec, read_commit
from tasks.shared.stops import PAUSED
from tasks.slot.run_shard import run_shards, shard_soft_time_limit
from tests.tasks.slot.test_shard_execution import MINILM


def _spec(tmp_path: Path, index: int, *, records: int = 2) -> ShardSpec:
    shard_input = tmp_path / "input" / f"shard-{index}.jsonl"
    shard_input.parent.mkdir(exist_ok=True)
    lines = [{"custom_id": f"r{index}-{n}", "input": f"sentence {index} {n}"} for n in range(records)]
    shard_input.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return ShardSpec(
        job_id="wave-job",
        shard_index=index,
        record_count=records,
        input_uri=shard_input.as_uri(),
        shard_prefix=(tmp_path / "shards" / f"{index:05d}").as_uri(),
        model=MINILM,
        input_field="input",
        params={"batch_size": 4},
    )


def test_each_shard_of_a_wave_runs_and_a_failing_one_fails_alone_under_its_own_task_id(tmp_path: Path) -> None:
    specs = [_spec(tmp_path, index) for index in range(3)]
    (tmp_path / "input" / "shard-1.jsonl").unlink()  # the middle shard's input is gone
    task_ids = [f"shard-wave-test-{uuid.uuid4().hex}-{index}" for index in range(3)]

    ran = run_shards.apply(
        args=([[task_id, spec.to_dict(), 60] for task_id, spec in zip(task_ids, specs, strict=True)],)
    )

    assert ran.get() == 3
    first, middle, last = (app.backend.get_task_meta(task_id) for task_id in task_ids)
    # A committed shard's outcome is its commit marker: nothing more is stored for it.
    assert (first["status"], middle["status"], last["status"]) == (states.PENDING, states.FAILURE, states.PENDING)
    assert read_commit(specs[0].shard_prefix) is not None and read_commit(specs[2].shard_prefix) is not None
    assert "no such object" in str(middle["result"])
    assert read_commit(specs[1].shard_prefix) is None


def test_a_wave_sent_again_answers_its_committed_shards_from_their_commit(tmp_path: Path) -> None:
    specs = [_spec(tmp_path, index) for index in range(2)]
    shards = [[f"shard-wave-test-{uuid.uuid4().hex}-{spec.shard_index}", spec.to_dict(), 60] for spec in specs]
    run_shards.apply(args=(shards,)).get()
    committed = [read_commit(spec.shard_prefix) for spec in specs]

    run_shards.apply(args=(shards,)).get()

    assert [read_commit(spec.shard_prefix) for spec in specs] == committed
    for spec in specs:
        attempts = Path(spec.shard_prefix.removeprefix("file://")) / "started"
        assert len(list(attempts.iterdir())) == 1, "the second run started no attempt"


def test_a_shard_of_a_paused_job_in_a_wave_stores_its_skip_under_its_own_task_id(tmp_path: Path) -> None:
    spec = _spec(tmp_path, 0)
    hold = tmp_path / "paused"
    hold.write_text("")  # the job's pause marker in storage
    task_id = f"shard-wave-test-{uuid.uuid4().hex}-0"

    run_shards.apply(args=([[task_id, replace(spec, hold_uri=hold.as_uri()).to_dict(), 60]],)).get()

    meta = app.backend.get_task_meta(task_id)
    assert (meta["status"], meta["result"]) == (
        states.SUCCESS,
        {"job_id": "wave-job", "shard_index": 0, "skipped": PAUSED},
    )
    assert read_commit(spec.shard_prefix) is None


@pytest.mark.timeout(60, method="thread")  # pytest-timeout's own signal method would arm the one timer
def test_a_shards_soft_time_limit_inside_a_wave_interrupts_it_alone_and_leaves_no_timer_behind() -> None:
    handler = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(SoftTimeLimitExceeded, match=r"soft time limit of 0\.2 s"), shard_soft_time_limit(0.2):
        time.sleep(10)
    assert time.monotonic() - started < 5

    with shard_soft_time_limit(0.2):
        pass  # a shard that ends in time: its timer is cleared and the handler before it is back
    time.sleep(0.4)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is handler


@pytest.mark.timeout(60, method="thread")
def test_a_timer_armed_by_someone_else_is_left_alone() -> None:
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        with shard_soft_time_limit(0.1):
            time.sleep(0.3)  # past the shard's limit: not interrupted, the other timer is kept
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.7
        time.sleep(1.0)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
