"""Pause and resume through the API, the CLI and the admin: status, flag, audit, refusals."""

from __future__ import annotations

from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from portal.audit.models import AuditEntry
from portal.jobs.models import Job, JobStatus
from portal.tenancy.models import Membership
from tasks.shared.leases import Lease
from tasks.shared.redis_client import redis_client
from tasks.shared.stops import PAUSED, arrival_flags
from tests.api.conftest import Caller


def arrival_hold(job_id: str) -> str | None:
    """What a shard of the job arriving now finds, as a shard reads it."""
    lease = Lease(f"batchery:lease:test-pause:{job_id}", "test")
    try:
        return lease.take_unless_flagged(arrival_flags(job_id))
    finally:
        redis_client().delete(lease.key)


def _running(tenant: Any, model: Any, root: Path) -> Job:
    return Job.objects.create(
        tenant=tenant,
        model=model,
        status=JobStatus.RUNNING,
        input_uri="file:///x.jsonl",
        output_uri=(root / "output.jsonl").as_uri(),
        shard_size=10,
    )


def test_a_running_job_pauses_and_resumes_through_the_api(
    caller: Callable[..., Caller], minilm: Any, tmp_path: Path
) -> None:
    alice = caller("acme")
    viewer = caller(alice.tenant, Membership.Role.VIEWER)
    job = _running(alice.tenant, minilm, tmp_path)

    assert viewer.client.post(f"/api/v1/jobs/{job.pk}/pause/").status_code == 403
    paused = alice.client.post(f"/api/v1/jobs/{job.pk}/pause/")
    assert (paused.status_code, paused.json()["status"]) == (200, "paused")
    assert arrival_hold(str(job.pk)) == PAUSED, "shards waiting in the broker find the flag"
    assert (tmp_path / "paused").exists(), "and the marker in storage, which outlives Redis"
    again = alice.client.post(f"/api/v1/jobs/{job.pk}/pause/")
    assert again.status_code == 409
    assert "only a running job can be paused" in again.json()["error"]["message"]

    resumed = alice.client.post(f"/api/v1/jobs/{job.pk}/resume/")
    assert (resumed.status_code, resumed.json()["status"]) == (200, "running")
    assert arrival_hold(str(job.pk)) is None
    assert not (tmp_path / "paused").exists()
    assert alice.client.post(f"/api/v1/jobs/{job.pk}/resume/").status_code == 409
    assert list(job.events.values_list("status", flat=True)) == ["paused", "running"]
    assert set(AuditEntry.objects.filter(target_id=str(job.pk)).values_list("action", flat=True)) == {
        "job.paused",
        "job.resumed",
    }


@pytest.mark.django_db
def test_the_cli_pauses_and_resumes_and_names_a_refusal(acme: Any, minilm: Any, tmp_path: Path) -> None:
    job = _running(acme, minilm, tmp_path)
    out = StringIO()
    call_command("job", "pause", str(job.pk), stdout=out)
    assert f"job {job.pk} paused" in out.getvalue()
    with pytest.raises(CommandError, match="only a running job can be paused"):
        call_command("job", "pause", str(job.pk))
    call_command("job", "resume", str(job.pk), stdout=out)
    assert f"job {job.pk} running" in out.getvalue()


@pytest.mark.django_db
def test_a_paused_job_can_be_cancelled(acme: Any, minilm: Any, tmp_path: Path) -> None:
    from portal.jobs.services.pause import job_pause
    from portal.jobs.services.stop import job_cancel

    job = job_pause(job=_running(acme, minilm, tmp_path))
    assert job_cancel(job=job).status == JobStatus.CANCELLING
