"""What callers do through the API is in the audit log, under the user behind their key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from portal.audit.models import AuditEntry
from portal.jobs.models import Job
from portal.openai_api.models import Batch
from portal.tenancy.invitations import invitation_accept
from portal.tenancy.models import ApiKey, Membership
from tests.api.conftest import Caller
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_keys_created_and_revoked_through_the_api_are_audited_under_the_caller(
    caller: Callable[..., Caller],
) -> None:
    admin = caller("acme", Membership.Role.ADMIN, username="alice")
    created = admin.client.post("/api/v1/api-keys/", {"name": "ci"}, format="json").json()

    assert admin.client.delete(f"/api/v1/api-keys/{created['id']}/").status_code == 204
    assert admin.client.delete(f"/api/v1/api-keys/{created['id']}/").status_code == 204

    revoked = ApiKey.objects.get(pk=created["id"])
    entries = list(AuditEntry.objects.filter(target_type="tenancy.apikey", target_id=str(revoked.pk)))
    assert [entry.action for entry in entries] == ["apikey.revoked", "apikey.created"], "newest first, revoked once"
    for entry in entries:
        assert (entry.actor, entry.actor_label, entry.tenant) == (admin.user, "alice", admin.tenant)
    assert revoked.revoked_at is not None
    (old, new) = entries[0].changes["revoked_at"]
    assert old is None and new.startswith(revoked.revoked_at.strftime("%Y-%m-%dT%H:%M:%S"))
    assert f"bk_{created['prefix']} (ci)" in entries[0].summary


def test_member_changes_through_the_api_are_audited_with_the_old_and_new_role(
    caller: Callable[..., Caller],
) -> None:
    owner = caller("acme", Membership.Role.OWNER, username="olivia")
    bob = UserFactory(username="bob")
    invited = owner.client.post("/api/v1/invitations/", {"username": "bob", "role": "viewer"}, format="json").json()
    added = invitation_accept(invitation_id=invited["id"], user=bob)
    owner.client.patch(f"/api/v1/members/{added.pk}/", {"role": "admin"}, format="json")
    assert owner.client.delete(f"/api/v1/members/{added.pk}/").status_code == 204

    entries = AuditEntry.objects.filter(action="membership.changed").order_by("at", "id")
    assert [entry.changes["role"] for entry in entries] == [[None, "viewer"], ["viewer", "admin"], ["admin", None]]
    assert [entry.summary for entry in entries] == [
        "bob joined acme as viewer by invitation",
        "bob changed from viewer to admin in acme",
        "bob removed in acme",
    ]
    assert [entry.actor for entry in entries] == [bob, owner.user, owner.user]
    assert {entry.tenant for entry in entries} == {owner.tenant}


def test_jobs_and_batches_cancelled_through_the_api_are_audited_under_the_caller(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    member = caller("acme", Membership.Role.MEMBER, username="mia")
    job = Job.objects.create(tenant=member.tenant, model=minilm, input_uri="file:///x.jsonl", shard_size=10)
    batch_job = Job.objects.create(tenant=member.tenant, model=minilm, input_uri="file:///y.jsonl", shard_size=10)
    batch = Batch.objects.create(
        id="batch_1", tenant=member.tenant, endpoint="/v1/embeddings", completion_window="24h",
        input_file_id="file-1", job=batch_job,
    )  # fmt: skip

    assert member.client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 200
    assert member.client.post(f"/v1/batches/{batch.id}/cancel").status_code == 200

    entries = AuditEntry.objects.filter(action="job.cancelled")
    assert {entry.target_id for entry in entries} == {str(job.pk), str(batch_job.pk)}
    assert {(entry.actor, entry.actor_label, entry.tenant) for entry in entries} == {
        (member.user, "mia", member.tenant)
    }
