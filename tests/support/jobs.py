"""Helpers to wait for and read jobs in pipeline tests, and to set up a running job whose shards
have committed, as the merge and the partial download find it."""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from portal.execution.settle import shard_record_failure, shard_record_success
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.tenancy.models import Tenant
from tasks.shared.specs import ShardManifest, commit_uri
from tasks.shared.storage import store_for
from tests.factories import ModelFactory


def wait_for_job(job: Job, *, timeout_s: float = 180.0, workers: dict[str, Any] | None = None) -> Job:
    """Poll the database until the job ends; on timeout, fail with the workers' logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.is_finished:
            return job
        time.sleep(0.25)
    logs = "\n".join(f"--- {name}\n{w.log_tail()}" for name, w in (workers or {}).items())
    raise AssertionError(f"job {job.id} still {job.status} after {timeout_s}s\n{logs}")


def read_lines(uri: str) -> list[dict[str, Any]]:
    with store_for(uri).open_read(uri) as stream:
        return [json.loads(line) for line in stream]


def _line(row: dict[str, Any]) -> bytes:
    return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


@dataclass(frozen=True)
class CommittedLayout:
    """The shape of a `committed_job`."""

    shards: int
    records: int
    """Records a shard, with ids `r0`, `r1`, ... across the job."""
    failed_shard: int
    """The one shard whose worker never committed: it fails for good when settled."""
    seed: int
    """Draws which records are error lines (about a fifth) and the others' embeddings."""


def committed_job(root: Path, layout: CommittedLayout, *, tenant: Tenant, output_format: str = "jsonl") -> Job:
    """A running job under `root` whose workers have all committed but the one of `layout.failed_shard`,
    none yet settled."""
    shards, records = layout.shards, layout.records
    job = Job.objects.create(
        tenant=tenant,
        model=ModelFactory(name="committed-embed", is_default=False),
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        errors_uri=(root / "errors.jsonl").as_uri(),
        output_format=output_format,
        shard_size=records,
        total_records=shards * records,
        shard_count=shards,
    )
    rng = random.Random(layout.seed)
    for index in range(shards):
        prefix = root / "shards" / f"{index:05d}"
        prefix.mkdir(parents=True)
        ids = [f"r{index * records + n}" for n in range(records)]
        (prefix / "input.jsonl").write_bytes(b"".join(_line({"custom_id": i, "input": "x"}) for i in ids))
        shard = Shard.objects.create(
            job=job,
            index=index,
            first_record=index * records,
            record_count=records,
            input_uri=(prefix / "input.jsonl").as_uri(),
            prefix_uri=prefix.as_uri(),
            status=ShardStatus.DISPATCHED,
        )
        if index != layout.failed_shard:
            _commit(shard, ids, rng)
    return job


def _commit(shard: Shard, ids: list[str], rng: random.Random) -> None:
    """What a worker's attempt leaves: its output and error lines under its own keys, then the commit marker."""
    prefix = Path(shard.prefix_uri.removeprefix("file://"))
    attempt = uuid.uuid4().hex
    lines = [
        _line({"custom_id": i, "error": {"code": "bad_input", "message": "too long"}})
        if rng.random() < 0.2
        else _line({"custom_id": i, "response": {"embedding": [rng.uniform(-1, 1) for _ in range(4)]}})
        for i in ids
    ]
    errors = [line for line in lines if b'"error"' in line]
    (prefix / f"{attempt}.out.jsonl").write_bytes(b"".join(lines))
    (prefix / f"{attempt}.errors.jsonl").write_bytes(b"".join(errors))
    manifest = ShardManifest(
        job_id=str(shard.job_id),
        shard_index=shard.index,
        attempt_id=attempt,
        worker="w@test",
        pid=1,
        output_uri=(prefix / f"{attempt}.out.jsonl").as_uri(),
        errors_uri=(prefix / f"{attempt}.errors.jsonl").as_uri(),
        records=len(ids),
        succeeded=len(ids) - len(errors),
        failed=len(errors),
        started_at=time.time(),
        finished_at=time.time(),
        compute_seconds=0.1,
        load_seconds=0.0,
        cache_hit=True,
        model_loads=0,
    )
    uri = commit_uri(shard.prefix_uri)
    store_for(uri).put_if_absent(uri, orjson.dumps(manifest.to_dict()))


def committed_settle(shard: Shard, layout: CommittedLayout) -> None:
    """What settling records for a shard of a `committed_job`: its commit, or for the failed shard its
    failure for good."""
    if shard.index == layout.failed_shard:
        shard_record_failure(shard, reason="RuntimeError: the engine crashed")
        return
    uri = commit_uri(shard.prefix_uri)
    shard_record_success(shard, ShardManifest.from_dict(orjson.loads(store_for(uri).read_bytes(uri))))
