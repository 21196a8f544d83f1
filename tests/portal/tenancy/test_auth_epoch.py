"""Every way a key, a membership, a tenant or a user changes what an API key grants bumps the auth epoch, so
no portal process serves a key from a copy read before: a query set's `update()` over tenancy rows (an
admin action's, a service's), and a user's deactivation, which has one way in (`users_deactivate`)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.sites import site
from django.contrib.auth.models import User
from django.db import connection
from django.test import RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from portal.audit.models import AuditEntry
from portal.tenancy import key_cache
from portal.tenancy.access import access_for_key
from portal.tenancy.apikeys import apikey_authenticate, apikey_create
from portal.tenancy.models import ApiKey, Membership
from portal.tenancy.services import users_deactivate
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("portal", "tasks", "gpuworkers", "bench")


@pytest.fixture(autouse=True)
def redis_answering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(key_cache, "_redis_retry_at", 0.0)


@pytest.fixture
def alice_key(acme: Any) -> tuple[ApiKey, str]:
    alice = UserFactory(username="alice")
    Membership.objects.create(tenant=acme, user=alice, role=Membership.Role.ADMIN)
    key, plaintext = apikey_create(tenant=acme, user=alice)
    assert apikey_authenticate(plaintext) is not None  # cached from here on
    with CaptureQueriesContext(connection) as captured:
        assert apikey_authenticate(plaintext) is not None
    assert captured.captured_queries == [], "served from this process's copy"
    return key, plaintext


def test_a_query_set_update_of_keys_memberships_or_tenants_holds_from_the_next_request(
    alice_key: tuple[ApiKey, str],
) -> None:
    key, plaintext = alice_key
    Membership.objects.filter(user=key.user, tenant=key.tenant).update(role=Membership.Role.VIEWER)
    found = apikey_authenticate(plaintext)
    assert found is not None and access_for_key(found).role == Membership.Role.VIEWER  # type: ignore[union-attr]
    type(key.tenant).objects.filter(pk=key.tenant_id).update(name="acme-renamed")
    assert apikey_authenticate(plaintext).tenant.name == "acme-renamed"  # type: ignore[union-attr]
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    assert apikey_authenticate(plaintext) is None


def test_writing_when_a_key_was_last_used_leaves_the_epoch_alone(alice_key: tuple[ApiKey, str]) -> None:
    key, plaintext = alice_key
    ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())
    with CaptureQueriesContext(connection) as captured:
        assert apikey_authenticate(plaintext) is not None
    assert captured.captured_queries == []


def test_a_user_deactivated_by_the_service_or_the_admin_action_loses_their_keys_at_once(
    alice_key: tuple[ApiKey, str], acme: Any
) -> None:
    key, plaintext = alice_key
    assert users_deactivate(users=User.objects.filter(pk=key.user_id), actor=None) == 1
    assert apikey_authenticate(plaintext) is None
    assert AuditEntry.objects.filter(action="user.deactivated").count() == 1

    bob = UserFactory(username="bob")
    Membership.objects.create(tenant=acme, user=bob)
    _, bobs = apikey_create(tenant=acme, user=bob)
    assert apikey_authenticate(bobs) is not None and apikey_authenticate(bobs) is not None
    operator = User.objects.create_superuser("root", "root@example.com", "x")
    request = RequestFactory().post("/admin/auth/user/")
    request.user = operator
    user_admin = site._registry[User]
    user_admin.message_user = lambda *args, **kwargs: None  # type: ignore[method-assign]
    user_admin.deactivate_users(request, User.objects.filter(pk=bob.pk))  # type: ignore[attr-defined]
    assert apikey_authenticate(bobs) is None


def _deactivations(path: Path) -> list[str]:
    """Calls in `path` that deactivate through a query set (`.update(is_active=...)`, or a `bulk_update` of
    `is_active`), which would skip the auth epoch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        named = {keyword.arg for keyword in node.keywords}
        bulk = node.func.attr == "bulk_update" and "is_active" in ast.unparse(node)
        if (node.func.attr == "update" and "is_active" in named) or bulk:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_code_deactivates_users_around_the_service() -> None:
    files = [path for package in PRODUCT for path in (REPO / package).rglob("*.py")]
    assert [call for path in files for call in _deactivations(path)] == []


def test_unticking_active_on_the_users_form_deactivates_through_the_service(alice_key: tuple[ApiKey, str]) -> None:
    key, plaintext = alice_key
    user = User.objects.get(pk=key.user_id)
    user.is_active = False
    request = RequestFactory().post(f"/admin/auth/user/{user.pk}/change/")
    request.user = User.objects.create_superuser("root", "root@example.com", "x")
    form = type("Form", (), {"changed_data": ["is_active"]})()
    site._registry[User].save_model(request, user, form, True)  # type: ignore[arg-type]
    assert apikey_authenticate(plaintext) is None
    assert AuditEntry.objects.filter(action="user.deactivated", target_id=str(user.pk)).exists()
