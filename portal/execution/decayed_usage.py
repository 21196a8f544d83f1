"""The fair-share ledger: each tenant's decayed GPU-seconds per GPU class, in PostgreSQL.

Kept in the database, not Redis, so that fair share survives a Redis restart unchanged.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.execution.fair_share import decayed
from portal.tenancy.models import FairShareUsage


def _elapsed(since: dt.datetime, now: dt.datetime) -> float:
    return (now - since).total_seconds()


def usage_read(*, tenant_ids: Collection[int], gpu_class_id: int, now: dt.datetime | None = None) -> dict[int, float]:
    """Each tenant's decayed GPU-seconds on the class now (0 for a tenant never charged there)."""
    now = now or timezone.now()
    half_life = settings.BATCHERY_FAIR_SHARE_HALF_LIFE_S
    rows = FairShareUsage.objects.filter(tenant_id__in=tenant_ids, gpu_class_id=gpu_class_id)
    usage = dict.fromkeys(tenant_ids, 0.0)
    for row in rows:
        usage[row.tenant_id] = decayed(row.usage, _elapsed(row.updated_at, now), half_life)
    return usage


def usage_by_class(rows: Iterable[FairShareUsage], *, now: dt.datetime | None = None) -> dict[str, float]:
    """A tenant's decayed GPU-seconds per GPU class name, from its ledger rows (prefetched with their class)."""
    now = now or timezone.now()
    half_life = settings.BATCHERY_FAIR_SHARE_HALF_LIFE_S
    return {row.gpu_class.name: round(decayed(row.usage, _elapsed(row.updated_at, now), half_life), 3) for row in rows}


def usage_charge(*, charges: Mapping[int, float], gpu_class_id: int, now: dt.datetime | None = None) -> None:
    """Add GPU-seconds (negative: a correction) to tenants' usage on a class, decaying what was there."""
    now = now or timezone.now()
    half_life = settings.BATCHERY_FAIR_SHARE_HALF_LIFE_S
    # All the charges or none; inside a caller's transaction (a tick), its own, with no savepoint of ours.
    with transaction.atomic(savepoint=False):
        for tenant_id in sorted(charges):
            row, _ = FairShareUsage.objects.select_for_update().get_or_create(
                tenant_id=tenant_id, gpu_class_id=gpu_class_id, defaults={"updated_at": now}
            )
            current = decayed(row.usage, _elapsed(row.updated_at, now), half_life)
            row.usage = max(0.0, current + charges[tenant_id])
            row.updated_at = now
            row.save(update_fields=["usage", "updated_at"])
