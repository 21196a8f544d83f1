"""Quotas hold under concurrent submissions: real PostgreSQL, real transactions, a live server."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from portal.jobs.models import Job
from portal.tenancy.models import Quota
from tests.api.conftest import Caller
from tests.factories import GpuClassFactory, ModelFactory

pytestmark = pytest.mark.django_db(transaction=True)

SUBMISSIONS = 20
ALLOWED = 3


def test_twenty_concurrent_submissions_against_a_quota_of_three_accept_exactly_three(
    live_server: Any, caller: Callable[..., Caller], write_jsonl: Callable[..., Path], settings: Any
) -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("row locks (select_for_update) need PostgreSQL")
    # A GPU class no worker serves: accepted jobs stay active (a worker of the session may be
    # running), so the quota's count cannot drop while the submissions race.
    model = ModelFactory(
        name="unserved", gpu_class=GpuClassFactory(name=f"unserved{uuid.uuid4().hex[:8]}"), is_default=False
    )
    alice = caller("acme")
    Quota.objects.filter(tenant=alice.tenant).update(max_concurrent_jobs=ALLOWED)
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(3)])
    settings.BATCHERY_INPUT_ROOTS = [path.parent.as_uri()]
    start = threading.Barrier(SUBMISSIONS)

    def submit(_: int) -> httpx.Response:
        with httpx.Client(base_url=live_server.url, timeout=60) as client:
            start.wait(timeout=30)
            return client.post(
                "/api/v1/jobs/",
                json={"model": model.name, "input_uri": path.as_uri()},
                headers={"Authorization": f"Bearer {alice.key}"},
            )

    with ThreadPoolExecutor(max_workers=SUBMISSIONS) as pool:
        responses = list(pool.map(submit, range(SUBMISSIONS)))

    codes = sorted(response.status_code for response in responses)
    assert codes == [201] * ALLOWED + [429] * (SUBMISSIONS - ALLOWED)
    for response in responses:
        if response.status_code == 429:
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert error["quota"] == {"name": "max_concurrent_jobs", "limit": 3, "current": 3, "requested": 1}
            assert "max_concurrent_jobs" in error["message"]
    assert Job.objects.filter(tenant=alice.tenant).count() == ALLOWED
