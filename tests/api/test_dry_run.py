"""POST /api/v1/jobs/ with dry_run: the report instead of a job, and nothing kept, the upload included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import override_settings
from rest_framework.test import APIClient

from portal.jobs.models import Job
from portal.jobs.services.uploads import uploads_root
from portal.tenancy.models import Tenant
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db

RECORDS = [{"custom_id": f"r{n}", "input": f"sentence number {n}"} for n in range(12)]
REPORT_FIELDS = {
    "accepted",
    "model",
    "adapters",
    "input_bytes",
    "unit",
    "sampled",
    "sample",
    "records",
    "estimated_records",
    "problem_count",
    "problems",
    "rejected",
    "input_tokens",
    "estimated_input_tokens",
    "over_length",
    "prefix_groups",
    "shards",
    "estimated_seconds",
    "estimated_gpu_seconds",
    "observed",
    "queue",
    "slots",
    "backlog_seconds",
    "share",
    "eta_seconds",
    "quota",
    "cost",
    "budget",
}


def _upload(client: Any, path: Path, **fields: Any) -> Any:
    with path.open("rb") as handle:
        return client.post("/api/v1/jobs/", {"file": handle, **fields}, format="multipart")


def _uploads(tenant: Tenant) -> list[Path]:
    root = Path(uploads_root(tenant.pk).removeprefix("file://"))
    return [path for path in root.rglob("*") if path.is_file()]


def test_a_dry_run_upload_answers_200_with_the_report_and_keeps_neither_job_nor_file(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(alice.client, write_jsonl(RECORDS), model=minilm.name, dry_run="true", shard_size=5)
    assert response.status_code == 200, response.json()
    report = response.json()
    assert set(report) == REPORT_FIELDS
    assert (report["accepted"], report["model"], report["records"], report["problems"]) == (
        True,
        f"{minilm.name}@{minilm.version}",
        12,
        [],
    )
    assert report["input_tokens"] == 12 * 5, "[CLS] sentence number n [SEP]"
    assert report["over_length"] == {"max_tokens": 256, "count": 0, "lines": []}
    assert report["shards"]["count"] == 3
    assert [shard["records"] for shard in report["shards"]["listed"]] == [5, 5, 2]
    assert report["estimated_gpu_seconds"] == pytest.approx(12 * 0.05)
    assert report["observed"] is False
    assert report["eta_seconds"] > 0
    assert report["quota"] == [
        {"quota": "max_concurrent_jobs", "limit": 10, "used": 0.0, "adds": 1.0, "left": 9.0, "refused": None},
        {"quota": "max_queued_records", "limit": 10_000_000, "used": 0.0, "adds": 12.0, "left": 9_999_988.0,
         "refused": None},
    ]  # fmt: skip
    assert not Job.objects.exists()
    assert _uploads(alice.tenant) == []


def test_a_dry_run_of_bad_lines_reports_them_and_still_keeps_nothing(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    path = write_jsonl([RECORDS[0], "not json", {"custom_id": "x"}])
    response = _upload(alice.client, path, model=minilm.name, dry_run="true")
    assert response.status_code == 200
    report = response.json()
    assert report["accepted"] is False
    assert [problem["line"] for problem in report["problems"]] == [2, 3]
    assert report["rejected"].startswith("input rejected: 2 bad lines: line 2: not valid JSON")
    assert report["records"] == 1
    assert _uploads(alice.tenant) == []


def test_a_dry_run_refused_before_reading_the_input_answers_400_and_drops_the_upload(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(alice.client, write_jsonl(RECORDS), model="gpt-17", dry_run="true")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
    assert _uploads(alice.tenant) == []


def test_a_dry_run_of_a_uri_takes_json_and_the_same_input_rules(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    path = write_jsonl(RECORDS)
    body = {"model": minilm.name, "input_uri": path.as_uri(), "dry_run": True}
    outside = alice.client.post("/api/v1/jobs/", body, format="json")
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "input_uri"
    with override_settings(BATCHERY_INPUT_ROOTS=[tmp_path.as_uri()]):
        inside = alice.client.post("/api/v1/jobs/", body, format="json")
    assert inside.status_code == 200, inside.json()
    assert inside.json()["records"] == 12
    assert path.exists(), "a file the tenant named is its own: only uploads are removed"
    assert not Job.objects.exists()


def test_the_schema_documents_the_dry_run_report() -> None:
    schema = yaml.safe_load(APIClient().get("/api/schema/").content)
    post = schema["paths"]["/api/v1/jobs/"]["post"]
    assert post["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/DryRunReport"
    }
    report = schema["components"]["schemas"]["DryRunReport"]
    assert set(report["properties"]) == REPORT_FIELDS
    assert "dry_run" in schema["components"]["schemas"]["JobCreateRequest"]["properties"]


def test_a_dry_run_of_a_large_upload_reads_a_prefix_and_says_it_extrapolated(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], settings: Any
) -> None:
    settings.BATCHERY_DRY_RUN_MAX_RECORDS = 100
    alice = caller("acme")
    path = write_jsonl([{"custom_id": f"r{n}", "input": "hello hello hello"} for n in range(5000)])
    response = _upload(alice.client, path, model=minilm.name, dry_run="true")
    assert response.status_code == 200, response.json()
    report = response.json()
    assert report["sampled"] is True and report["records"] == 100
    assert report["sample"]["stopped_by"] == "BATCHERY_DRY_RUN_MAX_RECORDS"
    assert report["sample"]["basis"] == "records" and report["estimated_records"] == 5000
    assert report["estimated_input_tokens"] == 5000 * 5
    assert not Job.objects.exists() and _uploads(alice.tenant) == []
