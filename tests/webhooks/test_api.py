"""/api/v1/webhooks/: registration (with its refusals naming the field), listing, deliveries, removal."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from portal.tenancy.models import Membership
from portal.webhooks.models import EVENT_TYPES, WebhookEndpoint
from portal.webhooks.services.delivery import webhook_deliver
from portal.webhooks.services.events import webhook_event_emit
from tests.api.conftest import Caller
from tests.webhooks.conftest import Receiver

pytestmark = pytest.mark.django_db

URL = "/api/v1/webhooks/"


@pytest.fixture
def admin(caller: Callable[..., Caller]) -> Caller:
    return caller("acme", Membership.Role.ADMIN)


def _refusal(response: Any, field: str) -> str:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == field and field in error["fields"], error
    return str(error["message"])


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://127.0.0.1:9/hook", "loopback"),  # not allowed: the allow-list names 127.0.0.1:8000 only
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://localhost:8000/hook", "loopback"),  # a name that resolves to 127.0.0.1 (or ::1)
        ("http://10.1.2.3/hook", "private"),
        ("http://[::ffff:127.0.0.1]/hook", "loopback"),
        ("http://100.64.0.1/hook", "non-public"),
        # IPv6 forms that carry an IPv4 address are judged by it (NAT64, 6to4, IPv4-compatible).
        ("http://[64:ff9b::169.254.169.254]/latest/meta-data/", "link-local"),
        ("http://[2002:7f00:1::1]/hook", "loopback"),
        ("http://[::10.1.2.3]/hook", "private"),
    ],
)
def test_a_url_that_resolves_to_a_non_public_address_is_refused_at_registration(
    admin: Caller, settings: Any, url: str, kind: str
) -> None:
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1:8000"]
    message = _refusal(admin.client.post(URL, {"url": url}, format="json"), "url")
    assert f"a {kind} address" in message and "BATCHERY_WEBHOOK_ALLOWED_HOSTS" in message
    assert not WebhookEndpoint.objects.exists()


def test_a_url_whose_name_server_does_not_answer_is_refused_within_the_resolve_bound(
    admin: Caller, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.BATCHERY_WEBHOOK_RESOLVE_TIMEOUT_S = 0.5
    answer = threading.Event()

    def silent_name_server(*args: Any, **kwargs: Any) -> Any:
        answer.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", silent_name_server)
    try:
        started = time.monotonic()
        response = admin.client.post(URL, {"url": "https://hooks.slow-dns.example/hook"}, format="json")
        took = time.monotonic() - started
    finally:
        answer.set()

    assert took < 2.0, "the web worker is not held by the name server"
    assert "hooks.slow-dns.example did not resolve within 0.5 s" in _refusal(response, "url")
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://example.com/hook"}, "url"),
        ({"url": "not a url"}, "url"),
        ({"url": "https://user:pw@93.184.215.14/hook"}, "url"),
        ({"url": "https://93.184.215.14/hook", "event_types": ["batch.done"]}, "event_types"),
        ({"url": "https://93.184.215.14/hook", "event_types": []}, "event_types"),
        ({}, "url"),
    ],
)
def test_bad_input_answers_400_naming_the_field(admin: Caller, body: dict[str, Any], field: str) -> None:
    _refusal(admin.client.post(URL, body, format="json"), field)


def test_an_endpoint_is_created_with_its_secret_shown_once(admin: Caller, settings: Any) -> None:
    settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    created = admin.client.post(
        URL, {"url": "http://127.0.0.1:9/hook", "event_types": ["job.progress", "batch.completed"]}
    )
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["secret"].startswith("whsec_") and body["enabled"] is True
    assert body["event_types"] == ["batch.completed", "job.progress"]
    listed = admin.client.get(URL).json()["results"]
    assert [item["id"] for item in listed] == [body["id"]] and "secret" not in listed[0]
    assert "secret" not in admin.client.get(f"{URL}{body['id']}/").json()
    # A public address needs no allow-list; leaving the event types out subscribes to all of them.
    public = admin.client.post(URL, {"url": "https://93.184.215.14/hook"}, format="json")
    assert public.status_code == 201 and public.json()["event_types"] == list(EVENT_TYPES)


def test_an_endpoint_past_the_tenants_cap_is_refused_naming_the_limit(
    admin: Caller, caller: Callable[..., Caller], settings: Any
) -> None:
    settings.BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT = 2
    for number in range(2):
        created = admin.client.post(URL, {"url": f"https://93.184.215.14/hook{number}"}, format="json")
        assert created.status_code == 201, created.content
    message = _refusal(admin.client.post(URL, {"url": "https://93.184.215.14/hook2"}, format="json"), "url")
    assert "BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT=2" in message
    assert WebhookEndpoint.objects.count() == 2
    # Another tenant's endpoints are counted apart.
    other = caller("globex", Membership.Role.ADMIN)
    assert other.client.post(URL, {"url": "https://93.184.215.14/hook"}, format="json").status_code == 201


def test_deliveries_are_listed_with_their_attempts_and_other_tenants_see_nothing(
    admin: Caller, caller: Callable[..., Caller], webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver(500)
    endpoint_id = admin.client.post(URL, {"url": server.url}, format="json").json()["id"]
    [delivery] = webhook_event_emit(tenant_id=admin.tenant.pk, event_type="job.failed", data={"id": "job-9"})
    webhook_deliver(delivery_id=delivery.pk)

    page = admin.client.get(f"{URL}{endpoint_id}/deliveries/")
    assert page.status_code == 200
    [listed] = page.json()["results"]
    assert (listed["event_type"], listed["status"], listed["attempt_count"]) == ("job.failed", "pending", 1)
    assert listed["payload"]["data"] == {"id": "job-9"}
    assert [(a["number"], a["status_code"]) for a in listed["attempts"]] == [(1, 500)]

    globex = caller("globex", Membership.Role.ADMIN)
    assert globex.client.get(f"{URL}{endpoint_id}/").status_code == 404
    assert globex.client.get(f"{URL}{endpoint_id}/deliveries/").status_code == 404
    assert globex.client.delete(f"{URL}{endpoint_id}/").status_code == 404
    member = caller("acme", Membership.Role.MEMBER)
    assert member.client.get(URL).status_code == 403

    assert admin.client.delete(f"{URL}{endpoint_id}/").status_code == 204
    assert not WebhookEndpoint.objects.filter(pk=endpoint_id).exists()
