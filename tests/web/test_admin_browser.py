"""The operators' admin in a real browser, against real workers: cancel and retry jobs through admin
actions, and drain a slot from the fleet page."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from portal.catalog.models import Model
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tasks.shared.fleet import draining_key
from tasks.shared.redis_client import redis_client
from tests.factories import ModelFactory
from tests.support.chaos_engines import FLAKY_MARKER
from tests.support.jobs import read_lines, wait_for_job
from tests.support.workers import start_worker, wait_until_consuming
from tests.web.conftest import PASSWORD

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture
def operator(db: None, fast_passwords: None) -> User:
    return User.objects.create_superuser("operator", "ops@example.com", PASSWORD)


def _admin_sign_in(page: Any) -> None:
    page.goto("/admin/login/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    with page.expect_navigation():
        page.click("input[type=submit]")
    expect(page.locator("#site-name")).to_be_visible()


def _run_action(page: Any, job: Job, action: str) -> None:
    page.goto("/admin/jobs/job/")
    page.check(f'input[name="_selected_action"][value="{job.pk}"]')
    page.select_option('select[name="action"]', action)
    with page.expect_navigation():
        page.click('button[name="index"]')


def _wait_status(job: Job, statuses: set[str], timeout_s: float = 60) -> Job:
    deadline = time.monotonic() + timeout_s
    while job.status not in statuses:
        assert time.monotonic() < deadline, f"job {job.pk} still {job.status}"
        time.sleep(0.2)
        job.refresh_from_db()
    return job


def test_an_operator_cancels_a_job_and_retries_failed_shards_through_admin_actions(
    pipeline_workers: dict[str, Any],
    page: Any,
    operator: User,
    acme: Any,
    write_jsonl: Callable[..., Path],
    tmp_path: Path,
    screenshot: Callable[[Any, str], Path],
) -> None:
    ModelFactory(
        name="slow-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.CLASSIFY,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": 0.3},
        is_default=False,
    )
    fixed = tmp_path / "dependency-is-back"
    ModelFactory(
        name="flaky-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.CLASSIFY,
        source="tests.support.chaos_engines:flaky_factory",
        default_params={"fixed_when_exists": str(fixed), "batch_size": 1},
        is_default=False,
    )
    slow = write_jsonl([{"custom_id": f"s{n}", "input": f"text {n}"} for n in range(40)], name="slow.jsonl")
    flaky = write_jsonl(
        [{"custom_id": f"f{n}", "input": f"{FLAKY_MARKER} {n}" if n % 4 == 0 else f"fine {n}"} for n in range(12)],
        name="flaky.jsonl",
    )
    failing = wait_for_job(
        job_submit(tenant=acme, request=JobRequest(model_name="flaky-echo", input_uri=str(flaky), shard_size=4)),
        workers=pipeline_workers,
    )
    assert failing.status == JobStatus.PARTIALLY_SUCCEEDED and failing.failed_records == 3
    running = job_submit(tenant=acme, request=JobRequest(model_name="slow-echo", input_uri=str(slow), shard_size=4))
    _wait_status(running, {JobStatus.RUNNING})
    _admin_sign_in(page)

    _run_action(page, running, "cancel_jobs")
    expect(page.locator(".messagelist")).to_contain_text(str(running.pk)[:8])
    running = _wait_status(running, {JobStatus.CANCELLED})
    assert running.succeeded_records < 40

    fixed.touch()
    _run_action(page, failing, "retry_jobs")
    expect(page.locator(".messagelist")).to_contain_text("retry")
    failing = wait_for_job(_wait_status(failing, {JobStatus.RUNNING, JobStatus.SUCCEEDED}), workers=pipeline_workers)
    assert failing.status == JobStatus.SUCCEEDED and failing.succeeded_records == 12
    assert [line["custom_id"] for line in read_lines(failing.output_uri)] == [f"f{n}" for n in range(12)]
    page.goto("/admin/jobs/job/?status__exact=cancelled")
    screenshot(page, "admin-jobs")


def test_an_operator_drains_a_slot_from_the_fleet_admin(
    page: Any, operator: User, screenshot: Callable[[Any, str], Path]
) -> None:
    from tasks.app import app

    name = f"drain{uuid.uuid4().hex[:6]}"
    queue = f"gpu.{name}"
    hostname = f"{name}@test"
    env = {
        **os.environ,
        "BATCHERY_SLOT": "0",
        "BATCHERY_GPU_CLASS": name,
        "BATCHERY_WORKER_NAME": hostname,
        "BATCHERY_QUEUE": queue,
        "CUDA_VISIBLE_DEVICES": "",
    }
    worker = start_worker(name, queue, env=env, log_dir=ARTIFACTS / "logs")
    try:
        wait_until_consuming([worker], timeout_s=60)
        _admin_sign_in(page)
        page.goto("/admin/ops/fleetslot/")
        row = page.locator("tr", has_text=hostname)
        expect(row).to_be_visible(timeout=20_000)
        screenshot(page, "admin-fleet")
        with page.expect_navigation():
            row.locator('input[value="Drain"]').click()
        expect(page.locator("tr", has_text=hostname)).to_contain_text("draining")

        def consuming() -> bool:
            replies = app.control.inspect([hostname], timeout=2).active_queues() or {}
            return queue in {q["name"] for q in replies.get(hostname, [])}

        deadline = time.monotonic() + 20
        while consuming():
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.5)
        assert worker.process.poll() is None, "a drained slot finishes its work and stays up"
    finally:
        worker.stop()
        redis_client().delete(draining_key(hostname))
