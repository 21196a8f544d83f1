"""Deliveries, one attempt at a time through the service the control task calls, to real receivers."""

from __future__ import annotations

import datetime as dt
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.utils import timezone
from standardwebhooks import Webhook

from portal.tenancy.models import Tenant
from portal.webhooks.models import DeliveryStatus, WebhookDelivery
from portal.webhooks.services.delivery import webhook_deliver, webhook_deliveries_overdue
from portal.webhooks.services.endpoints import webhook_endpoint_set_enabled
from portal.webhooks.services.events import webhook_event_emit
from tests.webhooks.conftest import Receiver, endpoint_for

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]


def _emit(tenant: Tenant, event_type: str = "job.completed") -> WebhookDelivery:
    [delivery] = webhook_event_emit(tenant_id=tenant.pk, event_type=event_type, data={"id": "job-1"})
    return delivery


def _deliver_until_done(delivery: WebhookDelivery, *, max_calls: int = 10) -> list[float]:
    """Call the service as the task would, waiting out each retry delay; the delays it asked for."""
    delays = []
    for _ in range(max_calls):
        retry_in = webhook_deliver(delivery_id=delivery.pk)
        if retry_in is None:
            return delays
        delays.append(retry_in)
        time.sleep(retry_in)
    raise AssertionError("the delivery never ended")


def test_an_event_reaches_an_allowed_receiver_once_signed_as_standard_webhooks_says(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver()
    endpoint = endpoint_for(acme, server.url)
    delivery = _emit(acme)

    assert _deliver_until_done(delivery) == []
    [request] = server.requests()
    assert request.path == "/hook" and request.headers["content-type"] == "application/json"
    assert request.headers["host"] == f"127.0.0.1:{server.port}"
    # The reference verification: signature, id and timestamp headers against the raw body.
    event = Webhook(endpoint.secret).verify(request.body, request.headers)
    assert event == delivery.payload
    assert (event["object"], event["type"], event["data"]) == ("event", "job.completed", {"id": "job-1"})
    assert request.headers["webhook-id"] == event["id"] and event["id"].startswith("evt_")
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + "A" * 43).verify(request.body, request.headers)

    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempt_count, delivery.last_status_code) == (DeliveryStatus.DELIVERED, 1, 200)
    assert webhook_deliver(delivery_id=delivery.pk) is None, "a delivered event is not sent again"
    assert len(server.requests()) == 1


def test_a_receiver_that_fails_twice_gets_the_event_on_the_third_attempt(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver(500, 503)
    endpoint = endpoint_for(acme, server.url)
    delivery = _emit(acme)

    assert _deliver_until_done(delivery) == [0.05, 0.1]
    requests = server.requests()
    assert len(requests) == 3
    assert len({request.headers["webhook-id"] for request in requests}) == 1, "the same message id on every attempt"
    for request in requests:
        Webhook(endpoint.secret).verify(request.body, request.headers)
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempt_count) == (DeliveryStatus.DELIVERED, 3)
    attempts = list(delivery.attempts.values_list("number", "status_code"))
    assert attempts == [(1, 500), (2, 503), (3, 200)]


def test_a_delivery_is_given_up_when_its_attempts_run_out(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver(500, 500, 500, 500)
    endpoint_for(acme, server.url)
    delivery = _emit(acme)

    _deliver_until_done(delivery)
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempt_count, delivery.next_attempt_at) == (DeliveryStatus.FAILED, 3, None)
    assert len(server.requests()) == 3


def test_a_redirect_is_not_followed_and_counts_as_a_failed_attempt(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver(302)
    endpoint_for(acme, server.url)
    delivery = _emit(acme)

    assert webhook_deliver(delivery_id=delivery.pk) == 0.05
    assert [request.path for request in server.requests()] == ["/hook"], "nothing went to the redirect's target"
    [attempt] = delivery.attempts.all()
    assert attempt.status_code == 302 and "redirects are not followed" in attempt.error
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.PENDING and delivery.last_status_code == 302


@pytest.mark.parametrize("host", ["127.0.0.1", "169.254.169.254"])
def test_a_destination_allowed_at_registration_is_refused_at_delivery_once_the_operator_withdraws_it(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver], host: str
) -> None:
    server = receiver()
    webhook_settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = [host]
    endpoint_for(acme, server.url.replace("127.0.0.1", host))
    delivery = _emit(acme)
    webhook_settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = []

    assert webhook_deliver(delivery_id=delivery.pk) is None, "a refusal is not retried"
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempt_count, delivery.last_status_code) == (DeliveryStatus.FAILED, 1, None)
    assert delivery.last_error.startswith(f"refused: {host} resolves to {host}")
    assert server.requests() == []


def test_the_sender_connects_to_the_address_it_checked_not_to_a_second_dns_answer(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name that answers once with an allowed address and then no more (or with another one): the
    request still reaches the checked address, under the name the endpoint was registered with."""
    server = receiver()
    name = "hooks.rebinding.test"
    webhook_settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS = [f"{name}:{server.port}"]
    real_getaddrinfo = socket.getaddrinfo
    answers = {"left": 2}  # one for the registration, one for the delivery's check

    def rebinding_dns(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            if answers["left"] == 0:
                raise socket.gaierror(socket.EAI_NONAME, "rebound")
            answers["left"] -= 1
            host = "127.0.0.1"
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_dns)
    endpoint_for(acme, f"http://{name}:{server.port}/hook")
    delivery = _emit(acme)

    assert webhook_deliver(delivery_id=delivery.pk) is None
    [request] = server.requests()
    assert request.headers["host"] == f"{name}:{server.port}"
    assert answers["left"] == 0


def test_a_disabled_endpoint_gets_nothing(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver]
) -> None:
    server = receiver()
    endpoint = endpoint_for(acme, server.url)
    delivery = _emit(acme)
    assert webhook_endpoint_set_enabled(endpoint=endpoint, enabled=False)

    assert webhook_deliver(delivery_id=delivery.pk) is None
    assert webhook_event_emit(tenant_id=acme.pk, event_type="job.completed", data={"id": "job-2"}) == []
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.FAILED and server.requests() == []


def test_the_sweep_finds_pending_deliveries_whose_message_was_lost(acme: Tenant, webhook_settings: Any) -> None:
    endpoint_for(acme, "http://127.0.0.1:9/hook")
    lost, fresh = _emit(acme), _emit(acme)
    WebhookDelivery.objects.filter(pk=lost.pk).update(next_attempt_at=timezone.now() - dt.timedelta(minutes=2))
    assert webhook_deliveries_overdue() == [lost.pk]
    assert fresh.pk not in webhook_deliveries_overdue()
