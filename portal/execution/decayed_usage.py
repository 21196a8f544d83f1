"""The fair-share ledger: each tenant's decayed GPU-seconds per GPU class, in PostgreSQL.

Kept in the database, not Redis, so that fair share survives a Redis restart unchanged.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping

from django.conf import settings
from django.db import connection, transaction
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
    """Add GPU-seconds (negative: a correction) to tenants' usage on a class, decaying what was there.

    On PostgreSQL one statement for all the tenants: every tick and every batch of endings charges
    several, and a locked read and a write a tenant were a tenth of the control plane's time at 1,000
    slots. Rows are written in tenant order, so two charging transactions never wait on each other
    crosswise."""
    if not charges:
        return
    now = now or timezone.now()
    half_life = settings.BATCHERY_FAIR_SHARE_HALF_LIFE_S
    if connection.vendor == "postgresql":
        tenants = sorted(charges)
        with connection.cursor() as cursor:
            cursor.execute(
                _CHARGE_SQL,
                {
                    "class": gpu_class_id,
                    "now": now,
                    "half_life": half_life,
                    "tenants": tenants,
                    "charges": [float(charges[tenant]) for tenant in tenants],
                },
            )
        return
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


# `decayed` in SQL. A new row holds its charge (at least 0); an existing one its decayed usage plus the
# charge, read again from the arrays (EXCLUDED holds the clamped value).
_CHARGE_SQL = f"""
INSERT INTO {FairShareUsage._meta.db_table} AS u (tenant_id, gpu_class_id, usage, updated_at)
SELECT c.tenant_id, %(class)s, GREATEST(0, c.charge), %(now)s
FROM unnest(%(tenants)s::bigint[], %(charges)s::double precision[]) AS c(tenant_id, charge)
ORDER BY c.tenant_id
ON CONFLICT (tenant_id, gpu_class_id) DO UPDATE SET
    usage = GREATEST(
        0,
        CASE WHEN EXCLUDED.updated_at > u.updated_at
             THEN u.usage * power(2, -EXTRACT(EPOCH FROM EXCLUDED.updated_at - u.updated_at) / %(half_life)s)
             ELSE u.usage END
        + (SELECT c.charge FROM unnest(%(tenants)s::bigint[], %(charges)s::double precision[]) AS c(tenant_id, charge)
           WHERE c.tenant_id = EXCLUDED.tenant_id)
    ),
    updated_at = EXCLUDED.updated_at
"""
