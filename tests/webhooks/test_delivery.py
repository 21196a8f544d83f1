"""Deliveries, one attempt at a time through the service the control task calls, to real receivers."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from standardwebhooks import Webhook

from portal.audit.models import AuditEntry
from portal.tenancy.models import Tenant
from portal.webhooks.models import DeliveryStatus, WebhookAttempt, WebhookDelivery
from portal.webhooks.services.delivery import webhook_deliver, webhook_deliveries_overdue
from portal.webhooks.services.endpoints import webhook_endpoint_set_enabled
from portal.webhooks.services.events import webhook_event_emit
from tests.factories import TenantFactory
from tests.webhooks.conftest import Receiver, TrickleReceiver, endpoint_for

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


def test_a_receiver_that_trickles_its_answer_is_cut_at_the_attempts_deadline(
    acme: Tenant, webhook_settings: Any, trickle: Callable[[], TrickleReceiver]
) -> None:
    """One byte a second never trips the per-read timeout; the attempt's deadline ends it all the same."""
    webhook_settings.BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S = 1.5
    server = trickle()
    endpoint_for(acme, server.url())
    delivery = _emit(acme)

    started = time.monotonic()
    assert webhook_deliver(delivery_id=delivery.pk) == 0.05  # failed: the first retry's delay
    took = time.monotonic() - started

    assert 1.4 < took < 4.0, took
    delivery.refresh_from_db()
    assert delivery.last_status_code is None and "BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S" in delivery.last_error
    [attempt] = delivery.attempts.all()
    assert attempt.duration_ms < 4000 and "deadline of 1.5 s" in attempt.error


def test_a_name_server_that_does_not_answer_is_cut_within_the_attempts_deadline(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look-up is part of the attempt: a resolver that never answers held the sender (and past its
    claim, letting a second sender in) for as long as the system's retries took."""
    webhook_settings.BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S = 1.0
    server = receiver()
    endpoint_for(acme, server.url)
    delivery = _emit(acme)
    answer = threading.Event()
    real_getaddrinfo = socket.getaddrinfo

    def silent_name_server(*args: Any, **kwargs: Any) -> Any:
        answer.wait(30)
        return real_getaddrinfo(*args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", silent_name_server)
    try:
        started = time.monotonic()
        assert webhook_deliver(delivery_id=delivery.pk) == 0.05  # failed, to be tried again
        took = time.monotonic() - started
    finally:
        answer.set()

    assert took < 2.5, took
    [attempt] = delivery.attempts.all()
    assert "did not resolve within 1 s" in attempt.error
    assert server.requests() == []


@pytest.mark.django_db(transaction=True)  # the attempt in flight runs in a thread of its own
def test_a_tenant_over_its_places_in_flight_waits_while_another_tenant_is_delivered(
    acme: Tenant, webhook_settings: Any, trickle: Callable[[], TrickleReceiver], receiver: Callable[..., Receiver]
) -> None:
    webhook_settings.BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S = 3.0
    webhook_settings.BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT = 1
    slow, fast = trickle(), receiver()
    endpoint_for(acme, slow.url())
    first, second = _emit(acme), _emit(acme)
    other = TenantFactory(name="globex")
    endpoint_for(other, fast.url)
    theirs = _emit(other)

    def deliver_first() -> None:
        try:
            webhook_deliver(delivery_id=first.pk)
        finally:
            connection.close()

    in_flight = threading.Thread(target=deliver_first)
    in_flight.start()
    try:
        slow.wait_for_connections(1)
        # The same delivery sent again while its attempt runs, and the tenant's next one: neither is tried.
        assert webhook_deliver(delivery_id=first.pk) is None
        assert webhook_deliver(delivery_id=second.pk) is None
        # Another tenant is not held up.
        assert webhook_deliver(delivery_id=theirs.pk) is None and len(fast.requests()) == 1
        assert in_flight.is_alive(), "the slow attempt should still be trickling"
    finally:
        in_flight.join(timeout=10)
    assert slow.connections == 1
    first.refresh_from_db()
    second.refresh_from_db()
    theirs.refresh_from_db()
    assert (first.attempt_count, second.attempt_count) == (1, 0)
    assert (second.status, second.next_attempt_at <= timezone.now()) == (DeliveryStatus.PENDING, True)
    assert theirs.status == DeliveryStatus.DELIVERED
    # Once the slow attempt has given its place back, the waiting delivery is tried: by this call, or by
    # the message its release sent, which a webhooks worker of the session (if one runs) may take first.
    webhook_deliver(delivery_id=second.pk)
    slow.wait_for_connections(2, timeout_s=15)
    assert slow.connections == 2


def test_failed_attempts_log_and_store_the_url_redacted(
    acme: Tenant, webhook_settings: Any, receiver: Callable[..., Receiver], caplog: pytest.LogCaptureFixture
) -> None:
    server = receiver(500)
    token_url = f"http://127.0.0.1:{server.port}/hooks/tok-SECRET1?key=SECRET2"
    endpoint_for(acme, token_url)
    # And one whose connection fails, with the token in its path.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    endpoint_for(acme, f"http://127.0.0.1:{closed_port}/hooks/tok-SECRET3")
    deliveries = webhook_event_emit(tenant_id=acme.pk, event_type="job.completed", data={"id": "job-1"})

    with caplog.at_level("INFO"):
        for delivery in deliveries:
            webhook_deliver(delivery_id=delivery.pk)

    logged = caplog.text
    assert f"http://127.0.0.1:{server.port}/…" in logged and f"http://127.0.0.1:{closed_port}/…" in logged
    stored = [delivery.last_error for delivery in WebhookDelivery.objects.all()]
    stored += list(WebhookAttempt.objects.values_list("error", flat=True))
    stored += list(AuditEntry.objects.values_list("summary", flat=True))
    for text in [logged, *stored]:
        assert "SECRET" not in text, text
