"""Prices set in the admin, a dry run's cost bounds, and the cost of the same job run on real workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from portal.jobs.billing import job_cost_so_far, priced_lines, usage_costs
from portal.jobs.models import JobStatus, JobUsage
from portal.jobs.requests import JobRequest
from portal.jobs.services.dry_run import job_dry_run
from portal.jobs.services.submit import job_submit
from tests.support.jobs import wait_for_job

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_prices_set_in_the_admin_give_a_dry_run_whose_bounds_hold_the_finished_job_s_cost(
    pipeline_workers: dict[str, Any],
    admin_client: Any,
    acme: Any,
    minilm: Any,
    write_jsonl: Callable[..., Path],
) -> None:
    response = admin_client.post(
        "/admin/catalog/price/add/",
        {
            "model": minilm.pk,
            "currency": "USD",
            "per_gpu_second": "0.02",
            "per_million_input_tokens": "150",
            "per_million_output_tokens": "0",
            "effective_from": timezone.now().date().isoformat(),
        },
    )
    assert response.status_code == 302, response.content
    path = write_jsonl(
        [{"custom_id": f"s-{n}", "input": f"Sentence {n} is about rivers and maps."} for n in range(400)]
    )
    request = JobRequest(model_name=minilm.name, input_uri=str(path), shard_size=100)

    report = job_dry_run(tenant=acme, request=request)
    assert report.cost.priced and report.cost.high is not None and 0 < report.cost.low < report.cost.high

    job = wait_for_job(job_submit(tenant=acme, request=request), workers=pipeline_workers)
    assert job.status == JobStatus.SUCCEEDED, job.error
    usage = JobUsage.objects.filter(job=job)
    cost = sum(usage_costs(priced_lines(usage)).values())
    assert report.cost.low <= cost <= report.cost.high, (report.cost, cost, usage.values().get())
    # What its shards cost, read as a running job's cost so far, is what its ledger line costs.
    assert job_cost_so_far(job) == cost
