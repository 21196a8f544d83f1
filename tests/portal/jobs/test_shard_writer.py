"""The planner's shard writer: shards of the given size, and nothing published when it is aborted."""

from __future__ import annotations

import uuid

import pytest

from portal.catalog.throughput import CostModel
from portal.execution.shard_cut import ShardCut
from portal.execution.shard_writer import ShardWriter
from portal.jobs.storage_layout import job_prefix
from tasks.shared.formats.records import Record
from tasks.shared.storage import store_for

pytestmark = pytest.mark.django_db

BY_TWO = ShardCut(cost=CostModel(per_record_s=1.0, per_char_s=0.0, observed=False), shard_size=2)


def _record(n: int) -> Record:
    return Record(line=n + 1, custom_id=f"r{n}", data={"custom_id": f"r{n}", "input": f"text {n}"})


def test_records_are_cut_into_shards_of_the_given_size() -> None:
    writer = ShardWriter(job_prefix(str(uuid.uuid4())), BY_TWO, input_field="input")
    for n in range(5):
        writer.add(_record(n))
    shards = writer.close()
    assert [(shard.first_record, shard.record_count) for shard in shards] == [(0, 2), (2, 2), (4, 1)]
    assert store_for(shards[2].input_uri).read_bytes(shards[2].input_uri).count(b"\n") == 1


def test_an_aborted_writer_publishes_no_part_of_the_shard_it_was_writing() -> None:
    job_id = str(uuid.uuid4())
    writer = ShardWriter(job_prefix(job_id), BY_TWO, input_field="input")
    for n in range(3):
        writer.add(_record(n))
    writer.abort()
    stored = list(store_for(job_prefix(job_id)).list_prefix(job_prefix(job_id)))
    assert [uri.rsplit("/", 1)[-1] for uri in stored] == ["shard-00000.jsonl"]
