"""`manage.py submit --dry-run`: the report, readably, and nothing submitted or created."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from portal.jobs.models import Job
from portal.tenancy.models import Quota, Tenant

pytestmark = pytest.mark.django_db


def test_submit_dry_run_prints_the_report_and_submits_nothing(
    acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence number {n}"} for n in range(12)])
    out = io.StringIO()
    call_command(
        "submit", "--model", minilm.name, "--input", str(path), "--tenant", "acme", "--shard-size", "5",
        "--dry-run", stdout=out,
    )  # fmt: skip
    text = out.getvalue()
    assert text.startswith("dry run: nothing was submitted\n")
    assert "input      " in text and "12 valid records" in text
    assert "tokens     60\n" in text
    assert "too long   0 records over the model's 256 tokens" in text
    assert "shards     3\n" in text
    assert "   0: 5 records, 0.2 s" in text and "   2: 2 records, 0.1 s" in text
    assert "0.6 GPU-seconds (a default rate: the model has not run)" in text
    assert "quota      max_concurrent_jobs: 0 of 10 used, +1, 9 left\n" in text
    assert text.rstrip().endswith("verdict    would be accepted")
    assert not Job.objects.exists()


def test_submit_dry_run_of_a_refused_job_says_why_and_exits_non_zero(
    acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    Quota.objects.filter(tenant=acme).update(max_concurrent_jobs=0)
    path = write_jsonl(['{"input": "ok"}', "{broken"])
    out = io.StringIO()
    with pytest.raises(CommandError, match="the job would be refused"):
        call_command(
            "submit", "--model", minilm.name, "--input", str(path), "--tenant", "acme", "--dry-run", stdout=out
        )
    text = out.getvalue()
    assert "problems   1 bad line; a submission would be refused:\n           line 2: not valid JSON" in text
    assert "max_concurrent_jobs: 0 of 0 used, +1, -1 left: REFUSED, quota max_concurrent_jobs exceeded" in text
    assert not Job.objects.exists()


def test_submit_dry_run_creates_no_tenant(minilm: Any, write_jsonl: Callable[..., Path]) -> None:
    with pytest.raises(CommandError, match="no tenant named 'nobody'"):
        call_command("submit", "--model", minilm.name, "--input", str(write_jsonl([{"input": "x"}])),
                     "--tenant", "nobody", "--dry-run")  # fmt: skip
    assert not Tenant.objects.filter(name="nobody").exists()
