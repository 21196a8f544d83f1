"""Webhook deliveries (the `webhooks` queue, its own worker: a receiver may take an attempt's whole
deadline, and must never hold the control lane): one attempt per message, the next one sent with its
delay; and the periodic sweep that sends the long-delayed retries, the deliveries that waited for a
place in flight, and what no message carried (see `portal.webhooks.services.delivery`)."""

from __future__ import annotations

from tasks import send
from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import DELIVER_WEBHOOK_TASK, WEBHOOKS_SWEEP_TASK

# Longer delays are left to the sweep: Redis hands an unacknowledged message with a distant ETA to
# another worker after the visibility timeout, and such copies would pile up for hours.
MAX_COUNTDOWN_S = 600.0


@app.task(name=DELIVER_WEBHOOK_TASK, base=ControlTask)
def deliver_webhook(delivery_id: int) -> None:
    from portal.webhooks.services.delivery import webhook_deliver

    retry_in = webhook_deliver(delivery_id=delivery_id)
    if retry_in is not None and retry_in <= MAX_COUNTDOWN_S:
        send.send_webhook_delivery(delivery_id, countdown=retry_in)


@app.task(name=WEBHOOKS_SWEEP_TASK, base=ControlTask)
def webhooks_sweep() -> int:
    from portal.webhooks.services.delivery import webhook_deliveries_overdue

    overdue = webhook_deliveries_overdue()
    for delivery_id in overdue:
        send.send_webhook_delivery(delivery_id)
    return len(overdue)
