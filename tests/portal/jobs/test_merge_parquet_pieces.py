"""A Parquet job's output is its shards' Parquet pieces concatenated, the file the JSONL path gave,
without reading the JSONL; a shard without a piece (it ran before pieces) sends the job the old way."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from portal.execution import merge
from portal.execution.dispatch import shard_spec
from portal.execution.merge import job_merge, job_merge_advance
from portal.jobs.models import Job, JobStatus
from tasks.shared.formats.parquet_pieces import PieceWriter
from tasks.shared.specs import ShardManifest, commit_uri
from tests.portal.jobs.test_merge import FAILED_SHARD, SHARDS, _job, _settle

pytestmark = pytest.mark.django_db(transaction=True)


def _with_pieces(job: Job, *, without: tuple[int, ...] = (), dims: dict[int, int] | None = None) -> Job:
    """Give each committed shard the piece its attempt would have written from the engine's arrays."""
    for shard in job.shards.order_by("index"):
        if shard.index == FAILED_SHARD or shard.index in without:
            continue
        marker = Path(commit_uri(shard.prefix_uri).removeprefix("file://"))
        manifest = ShardManifest.from_dict(orjson.loads(marker.read_bytes()))
        piece = Path(manifest.output_uri.removeprefix("file://")).with_suffix(".parquet")
        with piece.open("wb") as out:
            writer = PieceWriter(out, task="embed")
            for raw in Path(manifest.output_uri.removeprefix("file://")).read_bytes().splitlines():
                row = orjson.loads(raw)
                if "response" in row:
                    vector = np.asarray(row["response"]["embedding"], dtype=np.float32)
                    row["response"]["embedding"] = vector[: (dims or {}).get(shard.index, vector.size)]
                writer.add(row)
            writer.close()
        marker.write_bytes(orjson.dumps(replace(manifest, parquet_uri=piece.as_uri()).to_dict()))
    return job


def _merge(job: Job) -> Job:
    for shard in job.shards.order_by("index"):
        _settle(shard)
    job_merge(job_id=str(job.pk))
    job.refresh_from_db()
    return job


def _outputs(root: Path) -> tuple[Any, ...]:
    """The JSONL output's bytes; the Parquet output's schema, rows and row groups."""
    parquet = pq.ParquetFile(root / "output.parquet")
    groups = [parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups)]
    table = parquet.read()
    return (root / "output.jsonl").read_bytes(), table.schema, table.to_pydict(), groups


@pytest.fixture
def jsonl_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every conversion of the stitched JSONL to Parquet the merge makes."""
    calls: list[Any] = []
    convert = merge.jsonl_to_parquet

    def counted(*args: Any, **kwargs: Any) -> int:
        calls.append(args)
        return convert(*args, **kwargs)

    monkeypatch.setattr(merge, "jsonl_to_parquet", counted)
    return calls


def test_a_job_whose_shards_all_have_pieces_gets_the_old_paths_file_without_converting_its_jsonl(
    tmp_path: Path, jsonl_conversions: list[Any]
) -> None:
    old = _merge(_job(tmp_path / "old", output_format="parquet"))
    assert len(jsonl_conversions) == 1

    new = _merge(_with_pieces(_job(tmp_path / "new", output_format="parquet")))

    assert len(jsonl_conversions) == 1, "the pieces path read no JSONL"
    assert (new.status, new.succeeded_records, new.failed_records) == (
        old.status,
        old.succeeded_records,
        old.failed_records,
    )
    assert new.status == JobStatus.PARTIALLY_SUCCEEDED, "shard 4 failed for good: its error rows are in the file"
    assert _outputs(tmp_path / "new") == _outputs(tmp_path / "old"), "the JSONL byte for byte, the Parquet row for row"


def test_a_job_stitched_ahead_as_shards_finish_still_concatenates_every_shards_piece(
    tmp_path: Path, jsonl_conversions: list[Any]
) -> None:
    _merge(_job(tmp_path / "old", output_format="parquet"))
    job = _with_pieces(_job(tmp_path / "new", output_format="parquet"))
    shards = list(job.shards.order_by("index"))
    random.Random(5).shuffle(shards)
    for shard in shards:
        _settle(shard)
        job_merge_advance(job_id=str(job.pk))
    job_merge(job_id=str(job.pk))

    assert len(jsonl_conversions) == 1
    assert _outputs(tmp_path / "new") == _outputs(tmp_path / "old")


def test_a_shard_committed_before_pieces_sends_the_job_through_the_jsonl_as_before(
    tmp_path: Path, jsonl_conversions: list[Any]
) -> None:
    _merge(_job(tmp_path / "old", output_format="parquet"))

    job = _merge(_with_pieces(_job(tmp_path / "new", output_format="parquet"), without=(SHARDS - 1,)))

    assert len(jsonl_conversions) == 2
    assert job.status == JobStatus.PARTIALLY_SUCCEEDED
    assert _outputs(tmp_path / "new") == _outputs(tmp_path / "old")


def test_pieces_that_disagree_on_the_embedding_length_send_the_job_through_its_jsonl(
    tmp_path: Path, jsonl_conversions: list[Any]
) -> None:
    _merge(_job(tmp_path / "old", output_format="parquet"))

    job = _merge(_with_pieces(_job(tmp_path / "new", output_format="parquet"), dims={6: 2}))

    assert len(jsonl_conversions) == 2, "the JSONL is the truth: it decides, and names the line if it must refuse"
    assert job.status == JobStatus.PARTIALLY_SUCCEEDED
    assert _outputs(tmp_path / "new") == _outputs(tmp_path / "old")


def test_the_shards_of_a_parquet_job_are_told_to_write_pieces_but_not_those_of_a_retry_round(tmp_path: Path) -> None:
    job = _job(tmp_path, output_format="parquet")
    shard = job.shards.get(index=0)

    assert shard_spec(job, shard).output_format == "parquet"
    shard.round = 1
    assert shard_spec(job, shard).output_format == "jsonl", "a retry round's Parquet comes from the stitched JSONL"
