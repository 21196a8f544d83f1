"""The portal without a browser: sign-in, tenant scoping, roles, the switcher, the submit form."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from portal.jobs.services.uploads import uploads_root
from portal.ops.selectors import FLEET_HOSTS_PER_PAGE
from portal.tenancy.apikeys import apikey_authenticate
from portal.tenancy.models import ApiKey, Membership, Quota, Tenant
from portal.web.access import SESSION_TENANT
from tasks.shared.storage import store_for
from tests.factories import TenantFactory
from tests.support.fleet import beats_clear, beats_write, slot_beat
from tests.web.conftest import PASSWORD, make_job

pytestmark = pytest.mark.django_db

GOOD = [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(5)]
BAD = [
    '{"custom_id": "a", "input": "one"}',
    "{not json",
    '{"custom_id": "b", "input": "three"}',
    '{"custom_id": "a", "input": "four"}',
]


def _client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _uploads(tenant: Tenant) -> list[str]:
    root = uploads_root(tenant.pk)
    return list(store_for(root).list_prefix(root))


def _post_file(client: Client, path: Path, **fields: Any) -> Any:
    with path.open("rb") as handle:
        return client.post("/jobs/new/", {"file": handle, "input_format": "auto", "output_format": "jsonl", **fields})


def test_pages_need_sign_in_and_the_login_form_signs_in(person: Callable[..., User], acme: Tenant) -> None:
    person("alice", acme)
    client = Client()
    response = client.get("/")
    assert response.status_code == 302 and response["Location"] == "/login/?next=/"
    assert client.get("/login/").status_code == 200
    response = client.post("/login/", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/"
    page = client.get("/")
    assert page.status_code == 200
    assert b"Jobs" in page.content and b"acme" in page.content
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


def test_a_poll_after_sign_out_sends_the_whole_page_to_sign_in() -> None:
    response = Client().get("/jobs/live/", headers={"HX-Request": "true"})
    assert response.status_code == 204
    assert response["HX-Redirect"] == "/login/"


def test_another_tenants_job_answers_404_on_every_job_url(
    person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    globex = TenantFactory(name="globex")
    theirs = make_job(globex, minilm)
    ours = make_job(acme, minilm)
    client = _client(person("alice", acme))
    for suffix in ("", "live/", "output/", "errors/"):
        assert client.get(f"/jobs/{theirs.pk}/{suffix}").status_code == 404, suffix
    for suffix in ("cancel/", "retry/"):
        assert client.post(f"/jobs/{theirs.pk}/{suffix}").status_code == 404, suffix
    assert client.get(f"/jobs/{ours.pk}/").status_code == 200
    dashboard = client.get("/").content.decode()
    assert str(ours.pk) in dashboard and str(theirs.pk) not in dashboard


def test_a_viewer_reads_but_cannot_submit_cancel_or_retry(
    person: Callable[..., User], acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    running = make_job(acme, minilm, status=JobStatus.RUNNING)
    client = _client(person("vic", acme, role=Membership.Role.VIEWER))
    page = client.get(f"/jobs/{running.pk}/")
    assert page.status_code == 200
    assert b"cancel-job" not in page.content
    assert b"New job" not in client.get("/").content
    assert client.get("/jobs/new/").status_code == 403
    assert _post_file(client, write_jsonl(GOOD), model=str(minilm.pk)).status_code == 403
    refused = client.post(f"/jobs/{running.pk}/cancel/")
    assert refused.status_code == 403
    assert b"needs member or above" in refused.content
    assert client.post(f"/jobs/{running.pk}/retry/").status_code == 403
    running.refresh_from_db()
    assert running.status == JobStatus.RUNNING
    assert Job.objects.count() == 1


def test_a_member_sees_the_cancel_button_and_cancels_a_queued_job(
    person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    queued = make_job(acme, minilm, status=JobStatus.QUEUED)
    client = _client(person("alice", acme))
    assert b"cancel-job" in client.get(f"/jobs/{queued.pk}/").content
    response = client.post(f"/jobs/{queued.pk}/cancel/", follow=True)
    assert response.redirect_chain[-1][0] == f"/jobs/{queued.pk}/"
    queued.refresh_from_db()
    assert queued.status == JobStatus.CANCELLED
    assert b"cancel-job" not in response.content
    assert client.get(f"/jobs/{queued.pk}/cancel/").status_code == 405


def test_only_admins_manage_api_keys_and_a_new_key_is_shown_once(person: Callable[..., User], acme: Tenant) -> None:
    assert _client(person("alice", acme)).get("/api-keys/").status_code == 403
    admin = _client(person("ada", acme, role=Membership.Role.ADMIN))
    created = admin.post("/api-keys/", {"name": "etl", "expires_in_days": "30"})
    assert created.status_code == 200
    assert created["Cache-Control"] == "no-store"
    plaintext = created.context["created"]["plaintext"]
    assert plaintext.encode() in created.content
    key = apikey_authenticate(plaintext)
    assert key is not None and key.tenant == acme and key.name == "etl"
    assert plaintext.encode() not in admin.get("/api-keys/").content
    assert admin.post(f"/api-keys/{key.pk}/revoke/").status_code == 302
    assert apikey_authenticate(plaintext) is None
    other = ApiKey.objects.create(tenant=TenantFactory(name="globex"), user=key.user, prefix="feedface", hashed_key="x")
    assert admin.post(f"/api-keys/{other.pk}/revoke/").status_code == 404


def test_the_tenant_switcher_scopes_every_page_to_the_chosen_tenant(person: Callable[..., User], minilm: Any) -> None:
    user = person("sam", "acme", "globex")
    acme, globex = Tenant.objects.get(name="acme"), Tenant.objects.get(name="globex")
    acme_job, globex_job = make_job(acme, minilm), make_job(globex, minilm)
    client = _client(user)

    first = client.get("/").content.decode()
    assert client.session[SESSION_TENANT] == "acme"
    assert 'name="tenant"' in first and str(acme_job.pk) in first and str(globex_job.pk) not in first
    assert client.get(f"/jobs/{globex_job.pk}/").status_code == 404

    assert client.post("/tenant/", {"tenant": "globex"}).status_code == 302
    assert client.session[SESSION_TENANT] == "globex"
    second = client.get("/").content.decode()
    assert str(globex_job.pk) in second and str(acme_job.pk) not in second
    assert client.get(f"/jobs/{globex_job.pk}/").status_code == 200
    assert client.get(f"/jobs/{acme_job.pk}/").status_code == 404

    TenantFactory(name="initech")
    assert client.post("/tenant/", {"tenant": "initech"}).status_code == 403
    assert client.session[SESSION_TENANT] == "globex"


def test_a_removed_membership_falls_back_to_a_tenant_the_user_still_has(
    person: Callable[..., User], minilm: Any
) -> None:
    user = person("sam", "acme", "globex")
    client = _client(user)
    client.post("/tenant/", {"tenant": "globex"})
    Membership.objects.filter(user=user, tenant__name="globex").delete()
    assert client.get("/").status_code == 200
    assert client.session[SESSION_TENANT] == "acme"
    Membership.objects.filter(user=user).delete()
    response = client.get("/")
    assert response.status_code == 403
    assert b"not a member of any tenant" in response.content


def test_bad_lines_are_listed_by_number_and_nothing_is_kept(
    person: Callable[..., User], acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    client = _client(person("alice", acme))
    response = _post_file(client, write_jsonl(BAD), model=str(minilm.pk))
    assert response.status_code == 400
    html = response.content.decode()
    assert "The job was not submitted" in html
    assert '<span class="line-no">line 2</span>' in html
    assert '<span class="line-no">line 4</span>' in html
    assert "duplicate custom_id &#x27;a&#x27; (first on line 1)" in html
    assert "Input rejected: 2 bad lines:</p>" in html
    assert Job.objects.count() == 0
    assert _uploads(acme) == []


def test_form_errors_and_refusals_show_on_the_form(
    person: Callable[..., User], acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    client = _client(person("alice", acme))
    nothing = client.post("/jobs/new/", {"model": str(minilm.pk), "input_format": "auto", "output_format": "jsonl"})
    assert nothing.status_code == 400
    assert b"upload a file or give a storage URI" in nothing.content

    bad_params = _post_file(client, write_jsonl(GOOD), model=str(minilm.pk), params="[1, 2]")
    assert b"must be a JSON object" in bad_params.content

    outside = client.post(
        "/jobs/new/",
        {"model": minilm.pk, "input_uri": write_jsonl(GOOD).as_uri(), "input_format": "auto", "output_format": "jsonl"},
    )
    assert b"outside the locations this tenant may read" in outside.content

    columns = _post_file(client, write_jsonl(GOOD), model=str(minilm.pk), input_format="jsonl", text_column="text")
    assert columns.context["advanced_open"]
    assert b"text_column" in columns.content

    Quota.objects.filter(tenant=acme).update(max_concurrent_jobs=0)
    quota = _post_file(client, write_jsonl(GOOD), model=str(minilm.pk))
    assert b"A quota of acme refuses this job" in quota.content
    assert Job.objects.count() == 0
    assert _uploads(acme) == [], "a refused upload is deleted"


def test_a_valid_upload_creates_the_job_and_opens_its_page(
    person: Callable[..., User], acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    user = person("alice", acme)
    client = _client(user)
    form = client.get("/jobs/new/")
    assert form.status_code == 200 and b"all-MiniLM-L6-v2" in form.content and b"embed" in form.content
    response = _post_file(
        client, write_jsonl(GOOD), model=str(minilm.pk), params=json.dumps({"normalize": True}), shard_size="2"
    )
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert (job.tenant, job.created_by, job.params, job.shard_size, job.total_records) == (
        acme,
        user,
        {"normalize": True},
        2,
        5,
    )
    assert job.input_uri.startswith(uploads_root(acme.pk))


def test_live_parts_poll_while_a_job_runs_and_stop_once_it_has_ended(
    person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    running = make_job(acme, minilm, status=JobStatus.RUNNING)
    client = _client(person("alice", acme))
    live = client.get(f"/jobs/{running.pk}/live/").content.decode()
    assert 'hx-trigger="every 1s"' in live and 'aria-valuenow="0"' in live
    assert 'hx-trigger="every 1s"' in client.get("/jobs/live/").content.decode()

    Job.objects.filter(pk=running.pk).update(status=JobStatus.SUCCEEDED, succeeded_records=10, shard_count=1)
    ended = client.get(f"/jobs/{running.pk}/live/").content.decode()
    assert "hx-trigger" not in ended and 'aria-valuenow="100"' in ended
    assert 'hx-trigger="every 5s"' in client.get("/jobs/live/").content.decode()


def test_the_job_page_shows_shards_and_the_first_error_lines_and_streams_its_files(
    person: Callable[..., User], acme: Tenant, minilm: Any, tmp_path: Path
) -> None:
    errors = tmp_path / "errors.jsonl"
    lines = [{"custom_id": f"r{n}", "error": {"code": "bad_input", "message": "no"}} for n in range(25)]
    errors.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "output.jsonl"
    output.write_text('{"custom_id": "r0", "response": {}}\n')
    job = make_job(
        acme,
        minilm,
        status=JobStatus.PARTIALLY_SUCCEEDED,
        total_records=26,
        succeeded_records=1,
        failed_records=25,
        shard_count=2,
        errors_uri=errors.as_uri(),
        output_uri=output.as_uri(),
    )
    for index, (status, failed) in enumerate([(ShardStatus.SUCCEEDED, 0), (ShardStatus.SUCCEEDED, 25)]):
        Shard.objects.create(
            job=job, index=index, first_record=index * 13, record_count=13, input_uri="x", prefix_uri="y",
            status=status, failed_records=failed, attempt=1, worker="cpu0@test",
        )  # fmt: skip
    client = _client(person("alice", acme))
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    assert html.count('data-state="succeeded"') == 1 and html.count('data-state="errors"') == 1
    assert "attempt 1 · worker cpu0@test" in html
    assert html.count('<span class="badge plain status-failed">bad_input</span>') == 20
    assert "retry-job" in html
    download = client.get(f"/jobs/{job.pk}/errors/")
    assert download.status_code == 200
    assert download["Content-Disposition"] == f'attachment; filename="{job.pk}-errors.jsonl"'
    assert b"".join(download.streaming_content).decode() == errors.read_text()


def test_the_fleet_shows_slots_and_hides_another_tenants_shard(
    person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    ours = make_job(acme, minilm, status=JobStatus.RUNNING)
    theirs = make_job(TenantFactory(name="globex"), minilm, status=JobStatus.RUNNING)
    telemetry = {"utilization": 87, "memory_used": 40 * 2**30, "memory_total": 80 * 2**30}
    beats = dict(
        slot_beat(
            host="test-host",
            slot=slot,
            gpu_class="a100",
            gpus=[slot],
            loaded_models=["all-MiniLM-L6-v2@1"],
            current_shard=f"{job.pk}/{slot}",
            telemetry=[{"gpu": slot, **telemetry}],
        )
        for slot, job in enumerate([ours, theirs])
    )
    beats_write(beats, ttl_s=60)
    try:
        html = _client(person("alice", acme)).get("/fleet/").content.decode()
    finally:
        beats_clear(beats)
    assert "test-host" in html and "all-MiniLM-L6-v2@1" in html and "87%" in html
    assert f"/jobs/{ours.pk}/" in html
    assert str(theirs.pk) not in html and "busy (another tenant)" in html


def test_a_large_fleet_shows_a_line_per_class_and_its_hosts_a_page_at_a_time(
    person: Callable[..., User], acme: Tenant, minilm: Any
) -> None:
    ours = make_job(acme, minilm, status=JobStatus.RUNNING)
    prefix = f"rack-{uuid.uuid4().hex[:6]}-"
    hosts = [f"{prefix}{n:02d}" for n in range(FLEET_HOSTS_PER_PAGE + 4)]
    beats = dict(
        slot_beat(
            host=host,
            slot=slot,
            gpu_class=f"{prefix}{'big' if n % 2 else 'small'}",
            current_shard=f"{ours.pk}/{n}" if (n, slot) == (0, 0) else None,
            telemetry=[{"gpu": slot, "utilization": 50, "memory_used": 0, "memory_total": 1}],
        )
        for n, host in enumerate(hosts)
        for slot in range(2)
    )
    beats_write(beats, ttl_s=60)
    client = _client(person("alice", acme))
    try:
        first = client.get("/fleet/").content.decode()
        second = client.get("/fleet/live/?page=2").content.decode()
    finally:
        beats_clear(beats)

    shown = [re.findall(rf"<h2>({prefix}\d+)</h2>", html) for html in (first, second)]
    assert sorted(shown[0] + shown[1]) == hosts, "every host once, over the two pages"
    assert len(re.findall(r"<h2>[^<]+</h2>", first)) == FLEET_HOSTS_PER_PAGE
    assert "/fleet/?page=2" in first and "/fleet/live/?page=2" in second, "the polled part stays on its page"
    row = re.search(rf"<td>{prefix}small</td>(.*?)</tr>", first, re.DOTALL)
    assert row is not None
    figures = re.findall(r'<td class="num">([^<]+)</td>', row[1])
    assert figures == ["10", "20", "1", "19", "1", "50%"], "hosts, slots, busy, idle, running yours, utilization"


def test_models_and_usage_pages_show_the_tenants_own(person: Callable[..., User], acme: Tenant, minilm: Any) -> None:
    client = _client(person("vic", acme, role=Membership.Role.VIEWER))
    models = client.get("/models/").content.decode()
    assert "all-MiniLM-L6-v2" in models and "embed" in models
    usage = client.get("/usage/")
    assert usage.status_code == 200 and b"Concurrent jobs" in usage.content


def test_check_first_shows_the_dry_run_on_the_page_and_creates_nothing(
    person: Callable[..., User], acme: Tenant, minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    client = _client(person("alice", acme))
    long = " ".join(["hello"] * 300)  # over MiniLM's 256 tokens
    records = [*GOOD[:2], {"custom_id": "long", "input": long}, *GOOD[2:]]
    response = _post_file(client, write_jsonl(records), model=str(minilm.pk), shard_size="2", action="check")
    assert response.status_code == 200
    html = response.content.decode()
    assert "This job would be accepted" in html
    assert "choose the file again to submit it" in html
    report = response.context["report"]
    assert (report.records, report.shards.count, report.over_length.lines) == (6, 3, (3,))
    assert '<tr id="dry-run-over-length"><th scope="row">Too long</th><td class="num">1</td>' in html
    assert "over the model's 256 tokens: line 3<" in html
    assert "2 records · 0.1 s; 2 records · 0.1 s; 2 records · 0.1 s" in html
    assert Job.objects.count() == 0
    assert _uploads(acme) == [], "a checked upload is not kept"

    Quota.objects.filter(tenant=acme).update(max_concurrent_jobs=0)
    refused = _post_file(client, write_jsonl(BAD), model=str(minilm.pk), action="check")
    html = refused.content.decode()
    assert "This job would be refused" in html
    assert '<span class="line-no">line 2</span>not valid JSON' in html
    assert "Quota max_concurrent_jobs exceeded: limit 0, in use 0, this job needs 1" in html
    assert Job.objects.count() == 0
    assert _uploads(acme) == []
