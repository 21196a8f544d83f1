"""A wave's message (`run_shards`): its shards run one after another with the real bundled model, each one's
outcome stored in the real result backend under its own task id, where settling reads it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from celery import states

from tasks.app import app
from tasks.run_shard import run_shards
from tasks.specs import ShardSpec, read_commit
from tests.tasks.test_shard_execution import MINILM


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

    ran = run_shards.apply(args=([[task_id, spec.to_dict()] for task_id, spec in zip(task_ids, specs, strict=True)],))

    assert ran.get() == 3
    first, middle, last = (app.backend.get_task_meta(task_id) for task_id in task_ids)
    assert (first["status"], middle["status"], last["status"]) == (states.SUCCESS, states.FAILURE, states.SUCCESS)
    for meta, spec in ((first, specs[0]), (last, specs[2])):
        committed = read_commit(spec.shard_prefix)
        assert committed is not None and meta["result"] == committed.to_dict()
    assert "no such object" in str(middle["result"])
    assert read_commit(specs[1].shard_prefix) is None


def test_a_wave_sent_again_answers_its_committed_shards_from_their_commit(tmp_path: Path) -> None:
    specs = [_spec(tmp_path, index) for index in range(2)]
    shards = [[f"shard-wave-test-{uuid.uuid4().hex}-{spec.shard_index}", spec.to_dict()] for spec in specs]
    run_shards.apply(args=(shards,)).get()
    committed = [read_commit(spec.shard_prefix) for spec in specs]

    run_shards.apply(args=(shards,)).get()

    assert [read_commit(spec.shard_prefix) for spec in specs] == committed
    for (task_id, _), manifest in zip(shards, committed, strict=True):
        assert manifest is not None and app.backend.get_task_meta(task_id)["result"] == manifest.to_dict()
    for spec in specs:
        attempts = Path(spec.shard_prefix.removeprefix("file://")) / "started"
        assert len(list(attempts.iterdir())) == 1, "the second run started no attempt"
