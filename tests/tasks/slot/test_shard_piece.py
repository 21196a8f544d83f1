"""A shard attempt of a Parquet job writes its rows as a Parquet piece beside its JSONL and names it in
its commit; a piece that cannot be written is dropped, never the attempt."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
from celery.exceptions import SoftTimeLimitExceeded

from gpuworkers.batching import RecordResult
from tasks.shared.formats.parquet_output import jsonl_to_parquet
from tasks.shared.specs import ShardManifest, ShardSpec, read_commit
from tasks.shared.storage import store_for
from tasks.slot.shard_execution import execute_shard
from tasks.slot.shard_piece import ShardPiece
from tests.tasks.slot.test_shard_execution import MINILM

JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def _results(count: int) -> list[RecordResult]:
    results = []
    for n in range(count):
        if n % 4 == 1:
            results.append(RecordResult(f"r{n}", None, {"code": "engine_error", "message": "ValueError: no"}))
        else:
            vector = np.random.default_rng(n).standard_normal(384).astype(np.float32)
            results.append(RecordResult(f"r{n}", {"embedding": vector, "usage": {"prompt_tokens": n}}, None))
    return results


def _line(result: RecordResult) -> bytes:
    outcome = {"error": result.error} if result.error is not None else {"response": result.response}
    return orjson.dumps({"custom_id": result.custom_id, **outcome}, option=JSON_OPTIONS)


def _write(uri: str, results: list[RecordResult]) -> ShardPiece:
    with ShardPiece(store_for(uri), uri, task="embed") as piece:
        for result in results:
            piece.add(_line(result), result)
    return piece


def test_a_piece_from_the_engines_arrays_is_the_file_the_jsonl_converts_to(tmp_path: Path) -> None:
    results = _results(50)
    uri = (tmp_path / "a.output.parquet").as_uri()

    assert _write(uri, results).written
    converted = io.BytesIO()
    jsonl_to_parquet([_line(result) for result in results], converted, task="embed")
    assert (tmp_path / "a.output.parquet").read_bytes() == converted.getvalue()


def test_rows_parquet_cannot_hold_drop_the_piece_and_leave_nothing_behind(tmp_path: Path) -> None:
    several = RecordResult("many", {"embeddings": [np.ones(3, np.float32)] * 2, "usage": {"prompt_tokens": 2}}, None)
    piece = _write((tmp_path / "a.output.parquet").as_uri(), [*_results(3), several, *_results(2)])

    assert not piece.written
    assert list(tmp_path.iterdir()) == []


def test_an_attempt_that_fails_while_writing_drops_its_piece_and_a_time_limit_goes_through(tmp_path: Path) -> None:
    uri = (tmp_path / "a.output.parquet").as_uri()
    with pytest.raises(SoftTimeLimitExceeded), ShardPiece(store_for(uri), uri, task="embed") as piece:
        piece.add(_line(_results(1)[0]), _results(1)[0])
        raise SoftTimeLimitExceeded()

    assert not piece.written
    assert list(tmp_path.iterdir()) == []


def test_a_parquet_jobs_shard_commits_its_piece_and_a_jsonl_jobs_shard_writes_none(tmp_path: Path) -> None:
    shard_input = tmp_path / "input.jsonl"
    records: list[dict[str, Any]] = [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(5)]
    records[2]["input"] = {"text": "not a string"}
    shard_input.write_text("".join(json.dumps(record) + "\n" for record in records))
    spec = ShardSpec(
        job_id="job-1",
        shard_index=0,
        record_count=5,
        input_uri=shard_input.as_uri(),
        shard_prefix=(tmp_path / "parquet").as_uri(),
        model=MINILM,
        input_field="input",
        params={"batch_size": 4, "micro_batch_size": 2},
        output_format="parquet",
    )

    manifest = execute_shard(spec, worker="w1")

    assert isinstance(manifest, ShardManifest)
    assert manifest == read_commit(spec.shard_prefix)
    assert manifest.attempt_id in manifest.parquet_uri
    converted = io.BytesIO()
    with store_for(manifest.output_uri).open_read(manifest.output_uri) as lines:
        jsonl_to_parquet(lines, converted, task="embed")
    piece = store_for(manifest.parquet_uri).read_bytes(manifest.parquet_uri)
    assert piece == converted.getvalue()
    assert pq.read_table(io.BytesIO(piece)).column("error_code").to_pylist() == [None, None, "engine_error", None, None]

    plain = execute_shard(replace(spec, shard_prefix=(tmp_path / "jsonl").as_uri(), output_format="jsonl"), worker="w1")
    assert isinstance(plain, ShardManifest) and plain.parquet_uri == ""
    assert not list((tmp_path / "jsonl").rglob("*.parquet"))
