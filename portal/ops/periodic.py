"""The periodic sweep (`batchery.reconcile`, beat on the control queue): each app's own sweep in turn,
each in its own `try`, so that one that fails leaves the others swept; the next sweep tries it again."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

from django.utils import timezone

from portal.catalog.services import catalog_publish
from portal.execution.reconcile import jobs_reconcile
from portal.jobs.services.stop import jobs_expire_overdue
from portal.openai_api.services.sweep import batches_sweep
from portal.ops.metrics.sweeps import reconcile_sweep_record

logger = logging.getLogger(__name__)


def periodic_sweep() -> dict[str, int]:
    """What each sweep did, by name: jobs past their deadline expired (`jobs_expire_overdue`), the jobs'
    machinery (`jobs_reconcile`), then the batches' and files' (`batches_sweep`);
    the catalog is published for GPU hosts, so that a model added or changed in the admin reaches them."""
    started = time.perf_counter()
    done: dict[str, int] = {}
    for name, sweep in (
        ("deadlines", lambda: {"expired": jobs_expire_overdue(now=timezone.now())}),
        ("jobs", lambda: asdict(jobs_reconcile())),
        ("batches", lambda: asdict(batches_sweep(now=timezone.now()))),
        ("catalog", lambda: {"catalog_published": int(catalog_publish())}),
    ):
        try:
            done.update(sweep())
        except Exception:
            logger.exception("periodic sweep: the %s sweep failed; the next sweep tries again", name)
    reconcile_sweep_record(duration_s=time.perf_counter() - started)
    return done
