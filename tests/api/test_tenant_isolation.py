"""Two tenants: every endpoint answers 404 for the other tenant's objects, and lists show only one's own."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.models import Job, JobStatus, JobUsage
from portal.openai_api.models import Batch, File
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import ApiKey, Membership, Tenant
from tests.api.conftest import Caller

pytestmark = pytest.mark.django_db


def _objects_of(tenant: Tenant, model: Any, user: Any) -> dict[str, Any]:
    job = Job.objects.create(
        id=uuid.uuid4(),
        tenant=tenant,
        model=model,
        status=JobStatus.SUCCEEDED,
        input_uri="file:///nowhere.jsonl",
        shard_size=10,
        shard_count=1,
        total_records=1,
        succeeded_records=1,
        output_uri="file:///nowhere/output.jsonl",
        errors_uri="file:///nowhere/errors.jsonl",
        finished_at=timezone.now(),
    )
    JobUsage.objects.create(
        job=job, tenant=tenant, model=model, period=dt.date(2026, 11, 1), status=job.status, recorded_at=timezone.now()
    )
    file = File.objects.create(
        id=f"file-{uuid.uuid4().hex[:24]}",
        tenant=tenant,
        purpose="batch",
        filename="in.jsonl",
        bytes=1,
        uri="file:///x",
    )
    batch = Batch.objects.create(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        tenant=tenant,
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id=file.id,
        job=job,
        finalized_at=timezone.now(),
    )
    key, _ = apikey_create(tenant=tenant, user=user)
    return {
        "job": job,
        "file": file,
        "batch": batch,
        "key": key,
        "membership": Membership.objects.get(tenant=tenant, user=user),
    }


def test_a_tenant_never_sees_or_touches_another_tenants_objects(caller: Callable[..., Caller], minilm: Any) -> None:
    a = caller("acme", Membership.Role.OWNER)
    b = caller("globex", Membership.Role.OWNER)
    mine = _objects_of(a.tenant, minilm, a.user)
    theirs = _objects_of(b.tenant, minilm, b.user)
    job, file, batch = theirs["job"].pk, theirs["file"].pk, theirs["batch"].pk
    key, membership = theirs["key"].pk, theirs["membership"].pk

    requests = [
        ("get", f"/api/v1/jobs/{job}/"),
        ("post", f"/api/v1/jobs/{job}/cancel/"),
        ("post", f"/api/v1/jobs/{job}/retry/"),
        ("get", f"/api/v1/jobs/{job}/output/"),
        ("get", f"/api/v1/jobs/{job}/errors/"),
        ("get", f"/api/v1/api-keys/{key}/"),
        ("delete", f"/api/v1/api-keys/{key}/"),
        ("get", f"/api/v1/members/{membership}/"),
        ("patch", f"/api/v1/members/{membership}/"),
        ("delete", f"/api/v1/members/{membership}/"),
        ("get", f"/v1/files/{file}"),
        ("get", f"/v1/files/{file}/content"),
        ("delete", f"/v1/files/{file}"),
        ("get", f"/v1/batches/{batch}"),
        ("post", f"/v1/batches/{batch}/cancel"),
    ]
    for method, path in requests:
        response = getattr(a.client, method)(path, {"role": "viewer"} if method == "patch" else None, format="json")
        assert response.status_code == 404, (method, path, response.status_code)
        assert response.json()["error"]["type"] == "not_found_error", (method, path)

    # A batch over another tenant's file is refused as if the file did not exist.
    refused = a.client.post(
        "/v1/batches",
        {"input_file_id": file, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        format="json",
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "input_file_id"

    # Nothing of theirs changed.
    assert Job.objects.get(pk=job).status == JobStatus.SUCCEEDED
    assert ApiKey.objects.get(pk=key).revoked_at is None
    assert Membership.objects.get(pk=membership).role == Membership.Role.OWNER
    assert File.objects.filter(pk=file).exists()

    lists = {
        "/api/v1/jobs/": ("results", "id", str(mine["job"].pk)),
        "/api/v1/usage/": ("results", "job", str(mine["job"].pk)),
        "/api/v1/api-keys/": ("results", "id", None),
        "/api/v1/members/": ("results", "id", None),
        "/v1/files": ("data", "id", mine["file"].pk),
        "/v1/batches": ("data", "id", mine["batch"].pk),
    }
    for path, (field, key_field, expected) in lists.items():
        rows = a.client.get(path).json()[field]
        assert rows, path
        if expected is not None:
            assert [row[key_field] for row in rows] == [expected], path
    assert {row["id"] for row in a.client.get("/api/v1/api-keys/").json()["results"]} == set(
        ApiKey.objects.filter(tenant=a.tenant).values_list("id", flat=True)
    )
    assert {row["username"] for row in a.client.get("/api/v1/members/").json()["results"]} == {a.user.username}
    periods = a.client.get("/api/v1/usage/periods/").json()
    assert [row["jobs"] for row in periods] == [1]
