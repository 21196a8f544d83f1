"""Sending a delivery: claim it, check where it goes, POST it signed, record the attempt, and say when
to try again (`BATCHERY_WEBHOOK_RETRY_DELAYS_S`) or give up.

Signed as Standard Webhooks says (https://www.standardwebhooks.com/): `webhook-id` (the event's id, the
same on every attempt), `webhook-timestamp` and `webhook-signature`, made by the `standardwebhooks`
package. Redirects are never followed: a 3xx answer is a failed attempt.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from standardwebhooks import Webhook

from portal.webhooks.destinations import Destination, DestinationRefused, DestinationUnresolved, destination_check
from portal.webhooks.models import DeliveryStatus, WebhookAttempt, WebhookDelivery

logger = logging.getLogger(__name__)

USER_AGENT = "Batchery-Webhooks/1"
# An attempt holds its claim for its timeout of each step (httpx times connect, write and read
# apart) and a margin; a sender that died holds it no longer.
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
    None when there is none (delivered, given up, not due, or taken by another sender)."""
    now = timezone.now()
    timeout = settings.BATCHERY_WEBHOOK_TIMEOUT_S
    claimed = WebhookDelivery.objects.filter(
        pk=delivery_id, status=DeliveryStatus.PENDING, next_attempt_at__lte=now
    ).update(
        attempt_count=F("attempt_count") + 1, next_attempt_at=now + dt.timedelta(seconds=3 * timeout) + CLAIM_MARGIN
    )
    if not claimed:
        logger.info("webhook delivery %s not due or not pending: nothing to send", delivery_id)
        return None
    delivery = WebhookDelivery.objects.select_related("endpoint").filter(pk=delivery_id).first()
    if delivery is None:
        return None  # removed with its endpoint since the claim
    started = time.monotonic()
    try:
        outcome = _attempt(delivery, timeout=timeout)
    except Exception as exc:
        # Counted as a failed attempt, so that even an unforeseen failure ends the delivery in time.
        logger.exception("webhook delivery %s: the attempt failed unexpectedly", delivery_id)
        outcome = Outcome(status_code=None, error=f"{type(exc).__name__}: {exc}")
    return _record(delivery, outcome, started_at=now, duration_s=time.monotonic() - started)


def _attempt(delivery: WebhookDelivery, *, timeout: float) -> Outcome:
    if not delivery.endpoint.enabled:
        return Outcome(status_code=None, error="the endpoint is disabled", permanent=True)
    try:
        # Checked again at each attempt: the allow-list or the host's DNS may have changed since.
        destination = destination_check(delivery.endpoint.url, allowed_hosts=settings.BATCHERY_WEBHOOK_ALLOWED_HOSTS)
    except DestinationRefused as exc:
        return Outcome(status_code=None, error=f"refused: {exc}", permanent=True)
    except DestinationUnresolved as exc:
        return Outcome(status_code=None, error=str(exc))
    try:
        status_code = _post(delivery, destination, timeout=timeout)
    except httpx.TimeoutException:
        return Outcome(status_code=None, error=f"no answer within {timeout:g} s")
    except httpx.HTTPError as exc:
        return Outcome(status_code=None, error=f"{type(exc).__name__}: {exc}")
    if 300 <= status_code < 400:
        return Outcome(
            status_code=status_code, error=f"the receiver answered {status_code}; redirects are not followed"
        )
    if not 200 <= status_code < 300:
        return Outcome(status_code=status_code, error=f"the receiver answered {status_code}")
    return Outcome(status_code=status_code, error="")


def _post(delivery: WebhookDelivery, destination: Destination, *, timeout: float) -> int:
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
    # The request goes to the checked address; TLS still names (and checks the certificate of) the host.
    extensions = {"sni_hostname": destination.server_name} if destination.url.startswith("https:") else {}
    # No proxies from the environment: a proxy would resolve the name itself, past the check.
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        request = client.build_request("POST", destination.url, content=body, headers=headers, extensions=extensions)
        # Only the status matters; the body is not read, however large a receiver makes it.
        response = client.send(request, stream=True)
        response.close()
    return response.status_code


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
            delivery.endpoint.url,
            outcome.error,
            "given up" if retry_in is None else f"next attempt in {retry_in:g} s",
        )
    return retry_in


def webhook_deliveries_overdue() -> list[int]:
    """Pending deliveries well past their time: their message was lost, or their sender died."""
    late = timezone.now() - SWEEP_GRACE
    overdue = WebhookDelivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=late)
    return list(overdue.order_by("next_attempt_at").values_list("pk", flat=True)[:SWEEP_BATCH])
