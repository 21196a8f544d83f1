"""A shard's message as a worker takes it from the broker: its whole spec in its arguments, and printed
arguments (logs, Flower) that name the shard without printing the spec, for it and for its callbacks;
and the chords (waves) a tick sends them in."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
from django.utils import timezone

from bench.reconcile import write_commit
from portal.execution import capacity
from portal.execution.dispatch import wave_task_id
from portal.execution.scheduler import schedule_queue
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from tasks.app import app
from tasks.shared.config import gpu_queue
from tasks.shared.logging_setup import received_log_fields
from tests.factories import ModelFactory, TenantFactory
from tests.support.fleet import live_slots

pytestmark = pytest.mark.django_db(transaction=True)


def _pending_shards(gpu_class: Any, root: Path, *, count: int = 1, estimated_seconds: float = 1.0) -> list[Shard]:
    job = Job.objects.create(
        tenant=TenantFactory(name="messages"),
        model=ModelFactory(name="messages", gpu_class=gpu_class, is_default=False),
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        shard_size=3,
        total_records=3 * count,
        started_at=timezone.now(),
    )
    return [
        Shard.objects.create(
            job=job,
            index=index,
            first_record=3 * index,
            record_count=3,
            input_uri=(root / f"{index}.jsonl").as_uri(),
            prefix_uri=(root / f"shard-{index}").as_uri(),
            status=ShardStatus.PENDING,
            estimated_seconds=estimated_seconds,
        )
        for index in range(count)
    ]


def test_a_shards_message_prints_the_fields_that_name_it_and_carries_its_whole_spec(
    gpu_class: Any, tmp_path: Path
) -> None:
    [shard] = _pending_shards(gpu_class, tmp_path)
    job_id = str(shard.job_id)
    queue = gpu_queue(gpu_class.name)
    assert schedule_queue(queue) == 1

    with app.connection_for_read() as connection:
        message = connection.SimpleQueue(queue).get(timeout=5)
        message.ack()
    headers = message.headers
    [spec], _, embed = message.decode()

    assert headers["task"] == "batchery.run_shard"
    assert headers["argsrepr"] == f"({{'job_id': '{job_id}', 'shard_index': 0, 'record_count': 3}},)"
    assert headers["kwargsrepr"] == "{}"
    # What the worker's "received" log line is read for (`tasks.shared.logging_setup`).
    assert received_log_fields("batchery.run_shard", headers["argsrepr"], "{}") == {"job_id": job_id, "shard": 0}
    assert spec["input_uri"] == shard.input_uri and spec["model"]["name"] == "messages"

    callback = embed["chord"]
    [on_error] = callback["options"]["link_error"]
    for signature in (callback, on_error):
        assert signature["task"] == "batchery.shard_done"
        assert signature["args"] == [job_id, [0], queue]
        assert signature["options"]["argsrepr"] == repr((job_id, [0], queue))
        assert signature["options"]["kwargsrepr"] == "{}"


@pytest.fixture
def two_live_slots(gpu_class: Any) -> Iterator[str]:
    """Two slots consuming the class's queue, as their heartbeats announce them."""
    capacity._cached = None
    with live_slots(gpu_class.name, 2):
        yield gpu_queue(gpu_class.name)
    capacity._cached = None


def _sent_chords(queue: str, task_ids: dict[int, str] | None = None) -> dict[tuple[int, ...], list[int]]:
    """Each chord's shards, as its callback names them -> the shards its message carries (a wave's message
    several, `run_shards`); each shard's task id into `task_ids`, if given."""
    chords: dict[tuple[int, ...], list[int]] = defaultdict(list)
    with app.connection_for_read() as connection:
        messages = connection.SimpleQueue(queue)
        while True:
            try:
                message = messages.get(timeout=1)
            except Empty:
                break
            message.ack()
            [argument], _, embed = message.decode()
            if message.headers["task"] == "batchery.run_shards":
                carried = {spec["shard_index"]: task_id for task_id, spec, _ in argument}
                assert message.headers["id"] == wave_task_id(carried[min(carried)])
            else:
                carried = {argument["shard_index"]: message.headers["id"]}
            _, indexes, _ = embed["chord"]["args"]
            chords[tuple(indexes)].extend(carried)
            if task_ids is not None:
                task_ids.update(carried)
    return chords


def test_short_shards_are_sent_in_waves_each_chord_naming_its_shards_in_its_callback(
    gpu_class: Any, tmp_path: Path, two_live_slots: str, settings: Any
) -> None:
    settings.BATCHERY_SCHEDULER_SECONDS_AHEAD = 1.0
    settings.BATCHERY_SCHEDULER_MAX_SHARDS_PER_SLOT = 8
    # 10 ms shards: a slot gets 8 places (the cap), cut in two waves of 4; the window is 16.
    [first, *_] = _pending_shards(gpu_class, tmp_path, count=20, estimated_seconds=0.01)
    assert capacity.wave_size(two_live_slots, 0.01) == 4

    assert schedule_queue(two_live_slots) == 16

    task_ids: dict[int, str] = {}
    chords = _sent_chords(two_live_slots, task_ids)
    assert sorted(chords) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert all(shards == list(named) for named, shards in chords.items()), "one message a wave, in order"
    # Each row holds the task id its wave's message carries for it (made in SQL from the row's index).
    rows = Shard.objects.filter(job_id=first.job_id, status=ShardStatus.DISPATCHED)
    assert dict(rows.values_list("index", "task_id")) == task_ids
    assert len(set(task_ids.values())) == 16


def test_long_shards_go_alone(gpu_class: Any, tmp_path: Path, two_live_slots: str) -> None:
    _pending_shards(gpu_class, tmp_path, count=6, estimated_seconds=30.0)
    assert capacity.wave_size(two_live_slots, 30.0) == 1

    assert schedule_queue(two_live_slots) == 4, "two places a slot"

    assert sorted(_sent_chords(two_live_slots)) == [(0,), (1,), (2,), (3,)]


def test_a_waves_callback_settles_each_of_its_shards(gpu_class: Any, tmp_path: Path) -> None:
    from tasks.control.shard_done import shard_done

    # A fourth shard still runs: nothing is sent and the job does not merge, so no task outlives the test.
    shards = _pending_shards(gpu_class, tmp_path, count=4)
    Shard.objects.filter(pk__in=[shard.pk for shard in shards]).update(status=ShardStatus.DISPATCHED)
    for shard in shards[:3]:
        write_commit(shard)

    shard_done.apply(args=(str(shards[0].job_id), [0, 1, 2], gpu_queue(gpu_class.name))).get()

    statuses = dict(Shard.objects.filter(job_id=shards[0].job_id).values_list("index", "status"))
    assert statuses == {
        0: ShardStatus.SUCCEEDED,
        1: ShardStatus.SUCCEEDED,
        2: ShardStatus.SUCCEEDED,
        3: ShardStatus.DISPATCHED,
    }


def test_a_wave_that_ended_early_sends_its_unrun_shards_again_counting_only_the_one_that_started(
    gpu_class: Any, tmp_path: Path
) -> None:
    from tasks.control.shard_done import shard_done

    # The wave's time limit ended it inside shard 1: shard 0 committed, shard 2 never started.
    shards = _pending_shards(gpu_class, tmp_path, count=3)
    for shard in shards:
        Shard.objects.filter(pk=shard.pk).update(
            status=ShardStatus.DISPATCHED, attempt=1, task_id=f"shard-{shard.job_id}-{shard.index}-ended"
        )
    write_commit(shards[0])
    started = Path(shards[1].prefix_uri.removeprefix("file://")) / "started"
    started.mkdir(parents=True)
    (started / "attempt-1").write_text("w1")

    shard_done.apply(args=(str(shards[0].job_id), [0, 1, 2], gpu_queue(gpu_class.name))).get()

    rows = {row.index: row for row in Shard.objects.filter(job_id=shards[0].job_id)}
    assert rows[0].status == ShardStatus.SUCCEEDED
    # Both were sent again at once (the scheduler's tick after settling); only shard 1's sending counted.
    assert (rows[1].status, rows[1].attempt) == (ShardStatus.DISPATCHED, 2)
    assert (rows[2].status, rows[2].attempt) == (ShardStatus.DISPATCHED, 1)
    assert not {rows[1].task_id, rows[2].task_id} & {f"shard-{shards[0].job_id}-{i}-ended" for i in (1, 2)}


def test_a_lone_shard_with_no_outcome_yet_is_left_running(gpu_class: Any, tmp_path: Path) -> None:
    from tasks.control.shard_done import shard_done

    # A lone shard's callback with no outcome stored: its speculative copy ended, the shard itself runs on.
    [shard] = _pending_shards(gpu_class, tmp_path)
    Shard.objects.filter(pk=shard.pk).update(status=ShardStatus.DISPATCHED, attempt=1, task_id="shard-still-running")

    shard_done.apply(args=(str(shard.job_id), [0], gpu_queue(gpu_class.name))).get()

    shard.refresh_from_db()
    assert (shard.status, shard.attempt, shard.task_id) == (ShardStatus.DISPATCHED, 1, "shard-still-running")
