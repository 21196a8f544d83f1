from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from portal.jobs.models import Job
from portal.tenancy.models import Quota, Tenant


@pytest.mark.django_db
def test_tenant_create_makes_a_tenant_with_a_quota_and_refuses_a_second_of_the_same_name() -> None:
    out = io.StringIO()
    call_command("tenant", "create", "acme", "--priority", "7", stdout=out)
    assert out.getvalue().strip() == "tenant acme created"
    tenant = Tenant.objects.get(name="acme")
    assert tenant.priority == 7
    assert Quota.objects.filter(tenant=tenant).exists()
    with pytest.raises(CommandError, match="a tenant named 'acme' already exists"):
        call_command("tenant", "create", "acme")


def test_submit_refuses_a_bad_file_naming_its_lines(minilm: Any, write_jsonl: Callable[..., Path]) -> None:
    path = write_jsonl(['{"input": "ok"}', "{broken"])
    with pytest.raises(CommandError, match=r"input rejected: 1 bad line: line 2: not valid JSON"):
        call_command("submit", "--model", "all-MiniLM-L6-v2", "--input", str(path))
    assert not Job.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_submit_wait_shows_progress_and_reports_the_ending(
    pipeline_workers: dict[str, Any], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"input": f"sentence {n}"} for n in range(200)])
    out = io.StringIO()
    call_command(
        "submit", "--model", "all-MiniLM-L6-v2", "--input", str(path), "--tenant", "cli", "--shard-size", "50",
        "--wait", stdout=out,
    )  # fmt: skip
    job = Job.objects.get(tenant__name="cli")
    assert job.status == "succeeded"
    assert f"job {job.id} succeeded: 200 succeeded, 0 failed; output {job.output_uri}" in out.getvalue()
