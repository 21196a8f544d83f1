"""The merge stitches the first round as its shards finish, and its bytes are those of a merge at the end."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from portal.execution import merge
from portal.execution.merge import MergeCursor, _cursor_uri, _read_cursor, job_merge, job_merge_advance
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.storage_layout import parquet_output_uri
from tasks.shared.storage import store_for
from tests.factories import TenantFactory
from tests.support.jobs import CommittedLayout, committed_job, committed_settle

pytestmark = pytest.mark.django_db(transaction=True)

SHARDS = 9
RECORDS = 6
FAILED_SHARD = 4
"""This shard fails for good: its records become `shard_failed` error lines."""
LAYOUT = CommittedLayout(shards=SHARDS, records=RECORDS, failed_shard=FAILED_SHARD, seed=7)


def _job(root: Path, *, output_format: str = "jsonl") -> Job:
    """A running job whose shards all committed (one failed for good), none yet settled."""
    return committed_job(root, LAYOUT, tenant=TenantFactory(name="merger"), output_format=output_format)


def _settle(shard: Shard) -> None:
    """What settling (`SettleBatch`) records for the shard: its commit, or its failure for good."""
    committed_settle(shard, LAYOUT)


def _merged_at_the_end(root: Path, **fields: Any) -> Job:
    job = _job(root, **fields)
    for shard in job.shards.order_by("index"):
        _settle(shard)
    job_merge(job_id=str(job.pk))
    job.refresh_from_db()
    return job


def _merged_as_shards_finish(root: Path, **fields: Any) -> tuple[Job, list[MergeCursor]]:
    """Shards settle out of order, each stitched ahead as `endings_settle` does; the last one merges."""
    job = _job(root, **fields)
    shards = list(job.shards.order_by("index"))
    *early, last = shards
    random.Random(3).shuffle(early)
    cursors = []
    for shard in early:
        _settle(shard)
        job_merge_advance(job_id=str(job.pk))
        cursors.append(_read_cursor(job))
        assert not store_for(job.output_uri).exists(job.output_uri), "nothing is visible before the job ends"
        assert not store_for(job.errors_uri).exists(job.errors_uri)
    _settle(last)
    job_merge(job_id=str(job.pk))
    job.refresh_from_db()
    return job, cursors


def _ending(job: Job) -> tuple[Any, ...]:
    return job.status, job.succeeded_records, job.failed_records, job.error


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_merging_as_shards_finish_gives_the_bytes_of_merging_at_the_end(tmp_path: Path, output_format: str) -> None:
    whole = _merged_at_the_end(tmp_path / "whole", output_format=output_format)
    stepwise, cursors = _merged_as_shards_finish(tmp_path / "stepwise", output_format=output_format)

    assert max(cursor.output_next for cursor in cursors) == SHARDS - 1, "all but the last shard were stitched ahead"
    assert _ending(whole)[0] == JobStatus.PARTIALLY_SUCCEEDED
    assert _ending(stepwise) == _ending(whole)
    assert "shard 4: RuntimeError" in stepwise.error
    for name in ("output.jsonl", "errors.jsonl"):
        assert (tmp_path / "stepwise" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    if output_format == "parquet":
        parquet = parquet_output_uri(str((tmp_path / "stepwise").as_uri()))
        assert store_for(parquet).read_bytes(parquet) == (tmp_path / "whole" / "output.parquet").read_bytes()
    assert not store_for(_cursor_uri(stepwise)).exists(_cursor_uri(stepwise)), "the cursor goes with the merge"
    assert not list((tmp_path / "stepwise").glob(".*staged")), "no staged copy is left behind"


def test_a_merge_whose_staged_copy_was_lost_merges_every_shard_again(tmp_path: Path) -> None:
    whole = _merged_at_the_end(tmp_path / "whole")
    job = _job(tmp_path / "stepwise")
    for shard in job.shards.order_by("index")[: SHARDS - 1]:
        _settle(shard)
        job_merge_advance(job_id=str(job.pk))
    (staged,) = (tmp_path / "stepwise").glob(".output.jsonl.staged")
    staged.unlink()
    _settle(job.shards.get(index=SHARDS - 1))

    job_merge(job_id=str(job.pk))

    job.refresh_from_db()
    assert _ending(job) == _ending(whole)
    assert (tmp_path / "stepwise" / "output.jsonl").read_bytes() == (tmp_path / "whole" / "output.jsonl").read_bytes()


def test_a_cancelled_job_drops_what_was_stitched_ahead_and_merges_as_before(tmp_path: Path) -> None:
    job = _job(tmp_path)
    for shard in job.shards.order_by("index")[: FAILED_SHARD + 1]:
        _settle(shard)
        job_merge_advance(job_id=str(job.pk))
    assert _read_cursor(job).output_next == FAILED_SHARD + 1, "the failed shard was stitched ahead as 'shard_failed'"
    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLING)

    job_merge(job_id=str(job.pk), stop="cancelled")

    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED
    lines = [orjson.loads(line) for line in (tmp_path / "output.jsonl").read_bytes().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"r{n}" for n in range(SHARDS * RECORDS)]
    failed = lines[FAILED_SHARD * RECORDS : (FAILED_SHARD + 1) * RECORDS]
    assert {line["error"]["code"] for line in failed} == {"cancelled"}, "as merged whole: not 'shard_failed'"
    assert not list(tmp_path.glob(".*staged"))
    assert not store_for(_cursor_uri(job)).exists(_cursor_uri(job))


def test_a_retry_round_is_not_stitched_ahead_of_its_merge(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _settle(job.shards.get(index=0))
    Job.objects.filter(pk=job.pk).update(retry_round=1)

    job_merge_advance(job_id=str(job.pk))

    assert _read_cursor(job) == MergeCursor()


def test_after_stitching_ahead_the_merge_at_the_end_copies_only_the_last_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path)
    *early, last = job.shards.order_by("index")
    for shard in early:
        _settle(shard)
        job_merge_advance(job_id=str(job.pk))
    copied: list[str] = []
    copy = merge._copy
    monkeypatch.setattr(merge, "_copy", lambda uri, target: (copied.append(uri), copy(uri, target)))
    _settle(last)

    job_merge(job_id=str(job.pk))

    last.refresh_from_db()
    assert copied == [last.output_uri, last.errors_uri]
