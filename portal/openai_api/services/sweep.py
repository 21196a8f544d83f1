"""The OpenAI layer's part of the periodic sweep (`portal.ops.periodic`): validation sent again for
batches left `validating`, and the files and outputs that expired deleted (`expiry`)."""

from __future__ import annotations

import datetime as dt
import functools
import logging
from dataclasses import dataclass

from django.conf import settings

from portal.openai_api.services.expiry import files_expire
from portal.openai_api.services.validation import batches_validation_stalled, validation_lease_key, validation_task_id
from tasks import send
from tasks.shared.broker_probe import BrokerView, pending_task_ids
from tasks.shared.config import VALIDATION_QUEUE
from tasks.shared.leases import lease_holder

logger = logging.getLogger(__name__)


@dataclass
class BatchesSweepReport:
    revalidated: int = 0
    expired_files: int = 0


def batches_sweep(*, now: dt.datetime) -> BatchesSweepReport:
    report = BatchesSweepReport(revalidated=batches_validation_resend(now=now))
    try:
        report.expired_files = files_expire(now=now).files
    except Exception:
        # Files are not batches: the next sweep tries again, and this one has sent the validations already.
        logger.exception("sweep: expiring files failed; the next sweep tries again")
    return report


def batches_validation_resend(*, now: dt.datetime) -> int:
    """Send validation again for batches left `validating`: their message was never sent (broker down at
    the create's commit) or its worker died. A redelivery alone would not do: Redis gives an unacknowledged
    message back only after the visibility timeout, an hour, and never one that was not sent. The validation
    queue is read (whole) only if a batch needs it, and at most once."""

    @functools.cache
    def queued() -> BrokerView | None:
        return pending_task_ids({VALIDATION_QUEUE})

    resent = 0
    for batch_id in batches_validation_stalled(now=now):
        if lease_holder(validation_lease_key(batch_id)) is not None:
            continue
        view = queued()
        # A message delivered but unacknowledged, with no lease held, is with a dead worker: sent again.
        # A second run does nothing (`batch_validate`), so a worker that was only slow to start is harmless.
        if view is not None and validation_task_id(batch_id) in view.queued:
            continue
        logger.warning(
            "batch %s still validating after %ss; sending its validation again",
            batch_id,
            settings.BATCHERY_BATCH_VALIDATION_RESEND_S,
        )
        send.send_batch_validation(batch_id, task_id=validation_task_id(batch_id))
        resent += 1
    return resent
