"""Sending a delivery (on the `webhooks` queue, never the control one): take one of its tenant's places in
flight, claim it, check where it goes, POST it signed within the attempt's deadline, record the attempt,
and say when to try again (`BATCHERY_WEBHOOK_RETRY_DELAYS_S`) or give up.

The claim is the attempt's lease: it moves `next_attempt_at` past the attempt's deadline and a margin,
so a message sent again or redelivered while the attempt runs finds it not due and does nothing. A
tenant whose places (`BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT`) are all taken has its further
deliveries wait, due and unclaimed: each attempt that ends sends the tenant's waiting ones as places
free, and the sweep those whose message was lost. URLs reach logs and stored errors redacted (`url_redacted`).

Signed as Standard Webhooks says (https://www.standardwebhooks.com/): `webhook-id` (the event's id, the
same on every attempt), `webhook-timestamp` and `webhook-signature`, made by the `standardwebhooks`
package. Redirects are never followed: a 3xx answer is a failed attempt.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
import traceback
from dataclasses import dataclass

import httpcore
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from standardwebhooks import Webhook

from portal.webhooks.destinations import (
    Destination,
    DestinationRefused,
    DestinationUnresolved,
    destination_check,
    text_redacted,
    url_redacted,
)
from portal.webhooks.http import DeadlinePassed, post_status
from portal.webhooks.in_flight import Place, in_flight_release, in_flight_take
from portal.webhooks.models import DeliveryStatus, WebhookAttempt, WebhookDelivery
from tasks import send

logger = logging.getLogger(__name__)

USER_AGENT = "Batchery-Webhooks/1"
# An attempt holds its claim (and its place in flight) for its deadline and a margin, which covers
# resolving the host and recording; a sender that died holds them no longer.
CLAIM_MARGIN = dt.timedelta(seconds=30)
# The sweep sends pending deliveries this late: their own message was lost (or Redis was).
SWEEP_GRACE = dt.timedelta(seconds=60)
SWEEP_BATCH = 500
MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to."""

    status_code: int | None
    error: str
    permanent: bool = False
    """True when trying again cannot help (the destination is refused)."""

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def webhook_deliver(*, delivery_id: int) -> float | None:
    """Make the next attempt of a delivery that is due; return the seconds until the one after, or
    None when there is none (delivered, given up, not due, waiting for a place, or taken by another sender)."""
    delivery = WebhookDelivery.objects.select_related("endpoint").filter(pk=delivery_id).first()
    if delivery is None or delivery.status != DeliveryStatus.PENDING:
        logger.info("webhook delivery %s not pending: nothing to send", delivery_id)
        return None
    tenant_id = delivery.endpoint.tenant_id
    lease = dt.timedelta(seconds=settings.BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S) + CLAIM_MARGIN
    cap = settings.BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT
    place = in_flight_take(tenant_id=tenant_id, delivery_id=delivery_id, life_s=lease.total_seconds(), cap=cap)
    if place is Place.HELD:
        logger.info("webhook delivery %s has an attempt in flight: nothing to send", delivery_id)
        return None
    if place is Place.FULL:
        # Left due and unclaimed, noted as waiting: the tenant's next attempt to end sends it (`_wake_waiting`).
        logger.info(
            "webhook delivery %s waits: tenant %s has its %d attempts in flight "
            "(BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT)",
            delivery_id,
            tenant_id,
            cap,
        )
        return None
    try:
        return _claimed_attempt(delivery, lease=lease)
    finally:
        _wake_waiting(tenant_id=tenant_id, delivery_id=delivery_id, cap=cap)


def _wake_waiting(*, tenant_id: int, delivery_id: int, cap: int) -> None:
    """Give the attempt's place back and send the tenant's deliveries that waited for one."""
    try:
        for waiting in in_flight_release(tenant_id=tenant_id, delivery_id=delivery_id, cap=cap):
            send.send_webhook_delivery(waiting)
    except Exception:
        # The place lapses by itself; the sweep sends the waiting deliveries.
        logger.warning("tenant %s: waiting webhook deliveries not sent; the sweep sends them", tenant_id, exc_info=True)


def _claimed_attempt(delivery: WebhookDelivery, *, lease: dt.timedelta) -> float | None:
    now = timezone.now()
    claimed = WebhookDelivery.objects.filter(
        pk=delivery.pk, status=DeliveryStatus.PENDING, next_attempt_at__lte=now
    ).update(attempt_count=F("attempt_count") + 1, next_attempt_at=now + lease)
    if not claimed:
        logger.info("webhook delivery %s not due or not pending: nothing to send", delivery.pk)
        return None
    delivery.refresh_from_db(fields=["attempt_count"])
    started = time.monotonic()
    try:
        outcome = _attempt(delivery)
    except Exception as exc:
        # Counted as a failed attempt, so that even an unforeseen failure ends the delivery in time. Its
        # message may quote the URL: logged redacted, with the traceback's frames.
        error = text_redacted(f"{type(exc).__name__}: {exc}", delivery.endpoint.url)
        logger.error(
            "webhook delivery %s: the attempt failed unexpectedly: %s\n%s",
            delivery.pk,
            error,
            "".join(traceback.format_tb(exc.__traceback__)),
        )
        outcome = Outcome(status_code=None, error=error)
    return _record(delivery, outcome, started_at=now, duration_s=time.monotonic() - started)


def _attempt(delivery: WebhookDelivery) -> Outcome:
    if not delivery.endpoint.enabled:
        return Outcome(status_code=None, error="the endpoint is disabled", permanent=True)
    timeout = settings.BATCHERY_WEBHOOK_TIMEOUT_S
    deadline = settings.BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S
    started = time.monotonic()
    try:
        # Checked again at each attempt: the allow-list or the host's DNS may have changed since. The
        # look-up is part of the attempt, within its deadline.
        destination = destination_check(
            delivery.endpoint.url,
            allowed_hosts=settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS,
            resolve_timeout_s=min(timeout, deadline),
        )
    except DestinationRefused as exc:
        return Outcome(status_code=None, error=f"refused: {exc}", permanent=True)
    except DestinationUnresolved as exc:
        return Outcome(status_code=None, error=str(exc))
    try:
        status_code = _post(delivery, destination, timeout=timeout, deadline=deadline - (time.monotonic() - started))
    except httpcore.TimeoutException as exc:
        if isinstance(exc, DeadlinePassed) or time.monotonic() - started >= deadline:
            return Outcome(
                status_code=None,
                error=f"no full answer within the attempt's deadline of {deadline:g} s "
                "(BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S)",
            )
        return Outcome(status_code=None, error=f"no answer within {timeout:g} s")
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol) as exc:
        error = f"{type(exc).__name__}: {exc}"
        return Outcome(status_code=None, error=text_redacted(error, destination.url, delivery.endpoint.url))
    if 300 <= status_code < 400:
        return Outcome(
            status_code=status_code, error=f"the receiver answered {status_code}; redirects are not followed"
        )
    if not 200 <= status_code < 300:
        return Outcome(status_code=status_code, error=f"the receiver answered {status_code}")
    return Outcome(status_code=status_code, error="")


def _post(delivery: WebhookDelivery, destination: Destination, *, timeout: float, deadline: float) -> int:
    body = json.dumps(delivery.payload, separators=(",", ":"))
    sent_at = dt.datetime.now(dt.UTC)
    headers = {
        "host": destination.host_header,
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": delivery.event_id,
        "webhook-timestamp": str(int(sent_at.timestamp())),
        "webhook-signature": Webhook(delivery.endpoint.secret).sign(delivery.event_id, sent_at, body),
    }
    return post_status(
        destination,
        body=body.encode(),
        headers=list(headers.items()),
        step_timeout_s=timeout,
        deadline_s=deadline,
    )


def _record(delivery: WebhookDelivery, outcome: Outcome, *, started_at: dt.datetime, duration_s: float) -> float | None:
    number = delivery.attempt_count
    delays = settings.BATCHERY_WEBHOOK_RETRY_DELAYS_S
    retry_in = None if outcome.delivered or outcome.permanent or number > len(delays) else delays[number - 1]
    fields: dict[str, object] = {"last_status_code": outcome.status_code, "last_error": outcome.error[:MAX_ERROR_CHARS]}
    if outcome.delivered:
        fields.update(status=DeliveryStatus.DELIVERED, delivered_at=timezone.now(), next_attempt_at=None)
    elif retry_in is None:
        fields.update(status=DeliveryStatus.FAILED, next_attempt_at=None)
    else:
        fields.update(next_attempt_at=timezone.now() + dt.timedelta(seconds=retry_in))
    with transaction.atomic():
        # Only the claim's holder records: a delivery removed with its endpoint meanwhile is gone.
        recorded = WebhookDelivery.objects.filter(
            pk=delivery.pk, status=DeliveryStatus.PENDING, attempt_count=number
        ).update(**fields)
        if not recorded:
            logger.info("webhook delivery %s changed during attempt %d; its outcome is dropped", delivery.pk, number)
            return None
        WebhookAttempt.objects.create(
            delivery=delivery,
            number=number,
            started_at=started_at,
            duration_ms=round(duration_s * 1000),
            status_code=outcome.status_code,
            error=outcome.error[:MAX_ERROR_CHARS],
        )
    if not outcome.delivered:
        logger.warning(
            "webhook delivery %s attempt %d to %s failed: %s; %s",
            delivery.pk,
            number,
            url_redacted(delivery.endpoint.url),
            outcome.error,
            "given up" if retry_in is None else f"next attempt in {retry_in:g} s",
        )
    return retry_in


def webhook_deliveries_overdue() -> list[int]:
    """Pending deliveries well past their time: their message was lost, or their sender died."""
    late = timezone.now() - SWEEP_GRACE
    overdue = WebhookDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=late)
    return list(overdue.order_by("next_attempt_at").values_list("pk", flat=True)[:SWEEP_BATCH])
