"""The same records as JSONL, CSV, Parquet and gzip-compressed JSONL give the same job output; a
Parquet output holds one row per input, in order."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rest_framework.test import APIClient

from portal.jobs.models import JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.selectors import job_output_file
from portal.jobs.services.submit import job_submit
from portal.tenancy.apikeys import apikey_create
from tests.factories import MembershipFactory, UserFactory
from tests.support.jobs import read_lines, wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TEXTS = [f"Row {n} says something about {['tea', 'trains', 'tides'][n % 3]}, with a comma." for n in range(45)]
IDS = [f"doc-{n:03d}" for n in range(45)]


def _inputs(folder: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    jsonl = folder / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"custom_id": i, "input": t}) + "\n" for i, t in zip(IDS, TEXTS, strict=True)))
    gzipped = folder / "in.jsonl.gz"
    gzipped.write_bytes(gzip.compress(jsonl.read_bytes()))
    table = folder / "in.csv"
    with table.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "body", "ignored"])
        writer.writerows([i, t, "x"] for i, t in zip(IDS, TEXTS, strict=True))
    parquet = folder / "in.parquet"
    pq.write_table(pa.table({"id": IDS, "body": TEXTS}), parquet, row_group_size=10)
    columns = {"text_column": "body", "id_column": "id"}
    return {"jsonl": (jsonl, {}), "jsonl.gz": (gzipped, {}), "csv": (table, columns), "parquet": (parquet, columns)}


def test_jsonl_csv_parquet_and_gzip_inputs_give_the_same_output(
    pipeline_workers: dict[str, Any], acme: Any, minilm: Any, tmp_path: Path
) -> None:
    outputs = {}
    for name, (path, columns) in _inputs(tmp_path).items():
        job = job_submit(
            tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=20, **columns)
        )
        job = wait_for_job(job, workers=pipeline_workers)
        assert job.status == JobStatus.SUCCEEDED, (name, job.error)
        outputs[name] = read_lines(job.output_uri)

    reference = outputs.pop("jsonl")
    assert [line["custom_id"] for line in reference] == IDS
    expected = np.array([line["response"]["embedding"] for line in reference], dtype=np.float32)
    for name, lines in outputs.items():
        assert [line["custom_id"] for line in lines] == IDS, name
        got = np.array([line["response"]["embedding"] for line in lines], dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=name)


def test_a_parquet_output_round_trips_through_pyarrow_with_one_row_per_input_in_order(
    pipeline_workers: dict[str, Any], acme: Any, minilm: Any, tmp_path: Path
) -> None:
    path, _ = _inputs(tmp_path)["jsonl"]
    job = job_submit(
        tenant=acme,
        request=JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=20, output_format="parquet"),
    )
    job = wait_for_job(job, workers=pipeline_workers)
    assert job.status == JobStatus.SUCCEEDED, job.error

    user = UserFactory()
    MembershipFactory(user=user, tenant=acme)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {apikey_create(tenant=acme, user=user)[1]}")
    response = client.get(f"/api/v1/jobs/{job.pk}/output/")
    assert response.status_code == 200 and response["Content-Type"] == "application/vnd.apache.parquet"
    downloaded = tmp_path / "downloaded.parquet"
    downloaded.write_bytes(b"".join(response.streaming_content))

    table = pq.read_table(downloaded)
    assert table.num_rows == len(IDS)
    assert table.column("custom_id").to_pylist() == IDS
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert table.column("error_code").null_count == len(IDS)
    stored = pq.read_table(job_output_file(job)[0].removeprefix("file://"))
    assert stored.equals(table)
