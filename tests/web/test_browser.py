"""The portal in a real browser (headless Chromium) against a live server and real workers."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from portal.jobs.models import Job, JobStatus, ShardStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.stop import CannotStop, job_cancel
from portal.jobs.services.submit import job_submit
from portal.jobs.services.uploads import uploads_root
from portal.tenancy.models import Membership, Tenant
from tasks.shared.storage import join_uri, store_for
from tests.factories import ModelFactory, TenantFactory
from tests.support.fleet import beats_clear, beats_write, slot_beat
from tests.support.jobs import read_lines, wait_for_job
from tests.support.workers import wait_until_idle
from tests.web.conftest import make_job, sign_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

TOPICS = ["rivers", "GPUs", "bread", "the moon", "old maps", "jazz", "glaciers", "compilers"]


def _sentences(count: int) -> list[dict[str, str]]:
    return [
        {"custom_id": f"s-{n}", "input": f"Sentence {n} is about {TOPICS[n % len(TOPICS)]} and number {n * 7 % 13}."}
        for n in range(count)
    ]


def _slow_model() -> Any:
    """An echo model that takes 0.3 s a record, so a job of many small shards runs for a while."""
    return ModelFactory(
        name="slow-echo",
        engine="python",
        task="classify",
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": 0.3},
        is_default=False,
        description="Echoes each input back, slowly: for trying cancellation.",
    )


def _started_shards(job: Job) -> int:
    """Shards with at least one attempt started (each attempt leaves a marker before it runs)."""
    started = 0
    for shard in job.shards.all():
        prefix = join_uri(shard.prefix_uri, "started")
        started += any(True for _ in store_for(prefix).list_prefix(prefix))
    return started


def test_a_job_submitted_by_upload_shows_live_progress_and_its_output_downloads(
    pipeline_workers: dict[str, Any],
    page: Any,
    person: Callable[..., User],
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
) -> None:
    person("alice", acme)
    path = write_jsonl(_sentences(300))
    sign_in(page, "alice")

    page.goto("/jobs/new/")
    page.set_input_files("#id_file", str(path))
    expect(page.locator(".dropzone .chosen")).to_contain_text("input.jsonl")
    page.select_option("#id_model", str(minilm.pk))
    page.click("details.advanced summary")
    page.fill("#id_shard_size", "30")
    with page.expect_navigation():
        page.click("button:has-text('Submit job')")

    job = Job.objects.get()
    assert page.url.endswith(f"/jobs/{job.pk}/")
    bar = page.locator("#job-progress")
    assert int(bar.get_attribute("aria-valuenow")) < 100, "the page opened before the job ran"
    navigations: list[str] = []
    page.on("framenavigated", lambda frame: navigations.append(frame.url) if frame == page.main_frame else None)
    page.evaluate("window.sameDocument = true")

    expect(bar).to_have_attribute("aria-valuenow", "100", timeout=180_000)
    expect(page.locator("#job-status")).to_have_text("succeeded", timeout=30_000)
    assert navigations == [], "the progress came by polling, not by reloading"
    assert page.evaluate("window.sameDocument") is True
    expect(page.locator("#job-live")).not_to_have_attribute("hx-trigger", "every 1s")

    with page.expect_download() as download:
        page.click("#download-output")
    lines = [json.loads(line) for line in Path(download.value.path()).read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"s-{n}" for n in range(300)]
    assert all(len(line["response"]["embedding"]) == 384 for line in lines)


def test_a_file_with_bad_lines_is_refused_on_the_form_with_its_line_numbers(
    page: Any,
    person: Callable[..., User],
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
    screenshot: Callable[[Any, str], Path],
) -> None:
    person("alice", acme)
    path = write_jsonl(
        [
            {"custom_id": "a", "input": "one"},
            "{not json",
            {"custom_id": "b", "input": "three"},
            {"custom_id": "a", "input": "four"},
        ]
    )
    sign_in(page, "alice")
    page.goto("/jobs/new/")
    page.set_input_files("#id_file", str(path))
    with page.expect_navigation():
        page.click("button:has-text('Submit job')")

    problems = page.locator("#problems li")
    expect(problems).to_have_count(2)
    expect(problems.nth(0)).to_contain_text("line 2")
    expect(problems.nth(0)).to_contain_text("not valid JSON")
    expect(problems.nth(1)).to_contain_text("line 4")
    expect(problems.nth(1)).to_contain_text("duplicate custom_id 'a' (first on line 1)")
    screenshot(page, "submit-refused")
    assert Job.objects.count() == 0
    root = uploads_root(acme.pk)
    assert list(store_for(root).list_prefix(root)) == [], "the refused upload was deleted"


def test_a_member_cancels_a_running_job_and_its_remaining_shards_never_run(
    pipeline_workers: dict[str, Any],
    page: Any,
    person: Callable[..., User],
    acme: Tenant,
    write_jsonl: Callable[..., Path],
) -> None:
    _slow_model()
    person("alice", acme)
    records = 40
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"text {n}"} for n in range(records)])
    job = job_submit(tenant=acme, request=JobRequest(model_name="slow-echo", input_uri=str(path), shard_size=2))
    sign_in(page, "alice")
    page.goto(f"/jobs/{job.pk}/")
    expect(page.locator("#job-status")).to_have_text("running", timeout=60_000)
    expect(page.locator("#job-progress")).not_to_have_attribute("aria-valuenow", "0", timeout=60_000)

    page.once("dialog", lambda dialog: dialog.accept())
    with page.expect_navigation():
        page.click("#cancel-job")
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=30_000)

    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED
    total = job.shards.count()
    started = _started_shards(job)
    time.sleep(3)
    assert _started_shards(job) == started, "no shard started after the job was cancelled"
    assert started < total / 2
    succeeded = job.shards.filter(status=ShardStatus.SUCCEEDED).count()
    assert succeeded < total / 2
    errors = read_lines(job.errors_uri)
    assert len(errors) == job.failed_records == records - job.succeeded_records > records / 2
    assert {line["error"]["code"] for line in errors} == {"cancelled"}
    expect(page.locator('#shard-grid [data-state="stopped"]')).to_have_count(total - succeeded)


def test_another_tenants_job_answers_404_in_the_browser(
    page: Any, person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    theirs = make_job(TenantFactory(name="globex"), minilm)
    ours = make_job(acme, minilm)
    person("alice", acme)
    sign_in(page, "alice")
    assert page.goto(f"/jobs/{ours.pk}/").status == 200
    response = page.goto(f"/jobs/{theirs.pk}/")
    assert response.status == 404
    expect(page.locator("h1")).to_have_text("Not found")
    assert page.request.get(f"/jobs/{theirs.pk}/output/").status == 404


def _fake_heartbeats(running: Job) -> list[str]:
    """Heartbeats as two GPU slots would write them (the test worker sends none), one running a
    shard of `running`: the fields of `tasks.slot.heartbeat.slot_heartbeat`, under its keys."""
    gib = 2**30
    slots = [
        (0, ["all-MiniLM-L6-v2@1", "slow-echo@1"], f"{running.pk}/3", 91, 31 * gib),
        (1, ["all-MiniLM-L6-v2@1"], None, 4, 9 * gib),
    ]
    beats = dict(
        slot_beat(
            host="gpu-node-01",
            slot=slot,
            gpu_class="a100",
            gpus=[slot],
            pid=os.getpid(),
            loaded_models=models,
            current_shard=shard,
            telemetry=[{"gpu": slot, "utilization": utilization, "memory_used": memory, "memory_total": 80 * gib}],
        )
        for slot, models, shard, utilization, memory in slots
    )
    beats_write(beats, ttl_s=60)
    return list(beats)


def test_screenshots_of_the_portal(
    pipeline_workers: dict[str, Any],
    page: Any,
    person: Callable[..., User],
    acme: Tenant,
    minilm: Any,
    write_jsonl: Callable[..., Path],
    screenshot: Callable[[Any, str], Path],
) -> None:
    alice = person("alice", acme, role=Membership.Role.ADMIN)
    finished = job_submit(
        tenant=acme,
        user=alice,
        request=JobRequest(model_name=minilm.name, input_uri=str(write_jsonl(_sentences(400))), shard_size=25),
    )
    finished = wait_for_job(finished, workers=pipeline_workers)
    assert finished.status == JobStatus.SUCCEEDED
    _slow_model()
    slow_input = write_jsonl([{"input": f"text {n}"} for n in range(60)], name="slow.jsonl")
    running = job_submit(
        tenant=acme, user=alice, request=JobRequest(model_name="slow-echo", input_uri=str(slow_input), shard_size=3)
    )
    heartbeats: list[str] = []
    shots = []
    try:
        page.goto("/login/")
        shots.append(screenshot(page, "login"))
        sign_in(page, "alice")
        page.goto(f"/jobs/{running.pk}/")
        expect(page.locator("#job-status")).to_have_text("running", timeout=60_000)
        # A few polls, so the live chart has points.
        page.wait_for_function("document.querySelectorAll('#throughput-chart polyline').length > 0", timeout=30_000)
        page.wait_for_timeout(4000)
        shots.append(screenshot(page, "job-running"))

        page.goto("/")
        expect(page.locator("#dashboard-live tbody tr")).to_have_count(2)
        shots.append(screenshot(page, "dashboard"))

        page.goto("/jobs/new/")
        shots.append(screenshot(page, "submit"))

        page.goto(f"/jobs/{finished.pk}/")
        expect(page.locator("#shard-grid .shard")).to_have_count(16)
        page.wait_for_function("document.querySelectorAll('#throughput-chart polyline').length > 0")
        shots.append(screenshot(page, "job-finished"))

        heartbeats = _fake_heartbeats(running)
        page.goto("/fleet/")
        expect(page.locator("#fleet-live")).to_contain_text("gpu-node-01")
        shots.append(screenshot(page, "fleet"))

        for name, url in [("models", "/models/"), ("usage", "/usage/")]:
            page.goto(url)
            shots.append(screenshot(page, name))

        page.goto("/api-keys/")
        page.fill("#id_name", "nightly-etl")
        page.fill("#id_expires_in_days", "90")
        with page.expect_navigation():
            page.click("button:has-text('Create key')")
        expect(page.locator("#new-key-value")).to_contain_text("bk_")
        shots.append(screenshot(page, "api-keys"))
    finally:
        if heartbeats:
            beats_clear(heartbeats)
        with contextlib.suppress(CannotStop):  # free the worker for the next tests
            job_cancel(job=Job.objects.get(pk=running.pk))
        # Its cancellation and its shards' last callbacks done before the teardown truncates the tables.
        wait_for_job(running, workers=pipeline_workers)
        wait_until_idle(list(pipeline_workers.values()))
    assert all(shot.stat().st_size > 10_000 for shot in shots)
