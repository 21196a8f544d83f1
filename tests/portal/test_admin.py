"""The operators' admin: jobs (filters, search, cancel, retry, re-run), tenants and quotas, the
read-only audit log, and the fleet page with its Drain button."""

from __future__ import annotations

import io
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from gpuworkers.launcher import worker_env
from gpuworkers.slots import Slot
from portal.audit.models import AuditEntry
from portal.audit.services import audit_record
from portal.catalog.models import Model
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.ops.selectors import FLEET_HOSTS_PER_PAGE
from portal.ops.services import slot_drain
from portal.tenancy.models import Membership, Quota, Tenant
from tasks.shared.config import slot_own_queue
from tasks.shared.fleet import FLEET_KEY_PREFIX, draining_key, heartbeat_key
from tasks.shared.redis_client import redis_client
from tasks.shared.storage import store_for
from tasks.slot.heartbeat import slot_heartbeat
from tests.conftest import ARTIFACTS
from tests.factories import MembershipFactory, TenantFactory, UserFactory
from tests.support.fleet import beats_clear, beats_write, slot_beat
from tests.support.workers import start_worker, wait_until_consuming

JOBS_URL = "/admin/jobs/job/"
FLEET_URL = "/admin/ops/fleetslot/"
DRAIN_URL = "/admin/ops/fleetslot/drain/"


@pytest.fixture
def operator(db: None) -> User:
    return User.objects.create_superuser("root", "root@example.com", "secret-password")


@pytest.fixture
def admin_client(operator: User) -> Client:
    client = Client()
    client.force_login(operator)
    return client


def _job(tenant: Tenant, model: Model, status: str = JobStatus.QUEUED, uri: str = "file:///data/in.jsonl") -> Job:
    return Job.objects.create(tenant=tenant, model=model, input_uri=uri, shard_size=10, status=status)


def _listed(response: Any) -> set[Job]:
    assert response.status_code == 200
    return set(response.context["cl"].result_list)


def _messages(response: Any) -> list[str]:
    return [str(message) for message in get_messages(response.wsgi_request)]


def _act(client: Client, action: str, *jobs: Job) -> list[str]:
    response = client.post(JOBS_URL, {"action": action, "_selected_action": [str(job.pk) for job in jobs]}, follow=True)
    assert response.status_code == 200
    return _messages(response)


def test_the_jobs_list_filters_by_status_and_tenant_and_searches_id_input_and_tenant(
    admin_client: Client, acme: Tenant, minilm: Model
) -> None:
    globex = TenantFactory(name="globex")
    queued = _job(acme, minilm, uri="file:///data/reviews-2024.jsonl")
    failed = _job(acme, minilm, JobStatus.FAILED)
    other = _job(globex, minilm, JobStatus.FAILED)

    assert _listed(admin_client.get(JOBS_URL)) == {queued, failed, other}
    assert _listed(admin_client.get(JOBS_URL, {"status__exact": "failed"})) == {failed, other}
    assert _listed(admin_client.get(JOBS_URL, {"tenant__id__exact": globex.pk})) == {other}
    assert _listed(admin_client.get(JOBS_URL, {"q": "globex"})) == {other}
    assert _listed(admin_client.get(JOBS_URL, {"q": "reviews-2024"})) == {queued}
    assert _listed(admin_client.get(JOBS_URL, {"q": str(failed.pk)})) == {failed}
    today = timezone.now()
    by_day = {"created_at__year": today.year, "created_at__month": today.month, "created_at__day": today.day}
    assert _listed(admin_client.get(JOBS_URL, by_day)) == {queued, failed, other}


def test_cancel_cancels_a_queued_job_and_reports_one_that_cannot_be_cancelled(
    admin_client: Client, operator: User, acme: Tenant, minilm: Model
) -> None:
    queued = _job(acme, minilm)
    done = _job(acme, minilm, JobStatus.SUCCEEDED)

    messages = _act(admin_client, "cancel_jobs", queued, done)

    queued.refresh_from_db()
    assert queued.status == JobStatus.CANCELLED
    assert f"job {queued.pk}: cancelled" in messages
    assert (
        f"not cancelled: job {done.pk} is succeeded; only a queued, planning, running or paused job can be cancelled"
        in messages
    )
    (entry,) = AuditEntry.objects.filter(action="job.cancelled")
    assert (entry.actor, entry.actor_label, entry.tenant, entry.target_id) == (operator, "root", acme, str(queued.pk))
    assert entry.changes == {"status": ["queued", "cancelled"]}


@pytest.fixture
def ended_with_a_failure(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path], django_capture_on_commit_callbacks: Any
) -> Job:
    """A job planned into two shards that ended partially succeeded, with one record in its errors file."""
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(4)])
    job = job_submit(tenant=acme, request=JobRequest(model_name="all-MiniLM-L6-v2", input_uri=str(path), shard_size=2))
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.id))
    with store_for(job.errors_uri).open_write(job.errors_uri) as errors:
        errors.write(b'{"custom_id": "r3", "error": {"code": "model_error", "message": "boom"}}\n')
    Job.objects.filter(pk=job.pk).update(
        status=JobStatus.PARTIALLY_SUCCEEDED, succeeded_records=3, failed_records=1, finished_at=timezone.now()
    )
    job.refresh_from_db()
    return job


def test_retry_runs_the_failed_records_again_and_reports_a_job_with_nothing_to_retry(
    admin_client: Client,
    operator: User,
    ended_with_a_failure: Job,
    minilm: Model,
    django_capture_on_commit_callbacks: Any,
) -> None:
    job = ended_with_a_failure
    queued = _job(job.tenant, minilm)

    messages = _act(admin_client, "retry_jobs", job, queued)

    job.refresh_from_db()
    assert (job.status, job.retry_round) == (JobStatus.PLANNING, 1)
    assert f"job {job.pk}: planning, retry round 1" in messages
    with django_capture_on_commit_callbacks():
        job_plan(job_id=str(job.pk))  # the planning lane cuts the round
    (retry_shard,) = Shard.objects.filter(job=job, round=1)
    assert retry_shard.record_count == 1
    assert any(message.startswith(f"not retried: job {queued.pk} is queued") for message in messages)
    (entry,) = AuditEntry.objects.filter(action="job.retried")
    assert (entry.actor, entry.target_id) == (operator, str(job.pk))
    assert entry.changes == {"status": ["partially_succeeded", "planning"], "retry_round": [0, 1]}


def test_rerun_submits_a_new_queued_job_with_the_same_settings(
    admin_client: Client, operator: User, acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(3)])
    # A re-run is held to the tenant's input roots, as the tenant's own submission is.
    acme.storage_prefixes = [path.parent.as_uri() + "/"]
    acme.save()
    job = job_submit(
        tenant=acme,
        request=JobRequest(
            model_name="all-MiniLM-L6-v2",
            input_uri=str(path),
            shard_size=2,
            params={"batch_size": 4},
            deadline_seconds=600,
        ),
    )
    Job.objects.filter(pk=job.pk).update(status=JobStatus.FAILED)

    messages = _act(admin_client, "rerun_jobs", job)

    rerun = Job.objects.exclude(pk=job.pk).get()
    assert rerun.status == JobStatus.QUEUED
    assert rerun.created_by == operator
    same = ("tenant_id", "model_id", "input_uri", "params", "shard_size", "input_format", "output_format")
    assert {name: getattr(rerun, name) for name in same} == {name: getattr(job, name) for name in same}
    assert rerun.deadline_at is not None
    assert (rerun.deadline_at - rerun.created_at).total_seconds() == pytest.approx(600, abs=1)
    assert any(f"job {job.pk} re-run as" in message and str(rerun.pk) in message for message in messages)
    (entry,) = AuditEntry.objects.filter(action="job.rerun")
    assert (entry.actor, entry.target_id, entry.tenant) == (operator, str(job.pk), acme)


def test_rerun_reports_a_job_whose_input_is_gone(admin_client: Client, acme: Tenant, minilm: Model) -> None:
    acme.storage_prefixes = ["file:///nowhere/"]
    acme.save()
    job = _job(acme, minilm, JobStatus.FAILED, uri="file:///nowhere/gone.jsonl")
    (message,) = _act(admin_client, "rerun_jobs", job)
    assert message.startswith(f"job {job.pk} not re-run: cannot read the input")
    assert Job.objects.count() == 1
    assert not AuditEntry.objects.exists()


def test_a_shard_is_read_only_and_shows_its_worker_attempts_and_timings(
    admin_client: Client, ended_with_a_failure: Job
) -> None:
    shard = ended_with_a_failure.shards.first()
    assert shard is not None
    Shard.objects.filter(pk=shard.pk).update(worker="slot0-cpu@gpu-7", attempt=2, compute_seconds=1.5)
    page = admin_client.get(f"/admin/jobs/shard/{shard.pk}/change/")
    assert page.status_code == 200
    assert b"slot0-cpu@gpu-7" in page.content
    assert b'name="_save"' not in page.content
    assert admin_client.get("/admin/jobs/shard/", {"q": "gpu-7"}).status_code == 200
    job_page = admin_client.get(f"/admin/jobs/job/{ended_with_a_failure.pk}/change/")
    assert b"slot0-cpu@gpu-7" in job_page.content
    assert b"Compute seconds" in job_page.content


def _change_form_data(response: Any) -> dict[str, Any]:
    """What the admin change form would post back unchanged: the main form, the inlines' forms and
    their management forms, with their initial values."""
    assert response.status_code == 200
    forms = [response.context["adminform"].form]
    for inline in response.context["inline_admin_formsets"]:
        forms += [inline.formset.management_form, *inline.formset.forms]
    data: dict[str, Any] = {}
    for form in forms:
        for name in form.fields:
            value = form[name].value()
            if value is not None:
                data[form.add_prefix(name)] = value
    return data


def test_the_tenant_form_saves_quota_members_priority_and_prefixes_and_audits_each_change(
    admin_client: Client, operator: User, acme: Tenant
) -> None:
    url = f"/admin/tenancy/tenant/{acme.pk}/change/"
    bob = UserFactory(username="bob")
    data = _change_form_data(admin_client.get(url))
    assert data["quota-0-max_concurrent_jobs"] == 10
    data.update(
        {
            "priority": 8,
            "storage_prefixes": '["s3://datasets/acme/"]',
            "quota-0-max_concurrent_jobs": 3,
            "quota-0-max_input_bytes": 1000,
            "memberships-TOTAL_FORMS": 1,
            "memberships-0-user": bob.pk,
            "memberships-0-role": "admin",
        }
    )

    response = admin_client.post(url, data)

    assert response.status_code == 302, response.context and response.context["adminform"].form.errors
    acme.refresh_from_db()
    assert (acme.priority, acme.storage_prefixes) == (8, ["s3://datasets/acme/"])
    quota = Quota.objects.get(tenant=acme)
    assert (quota.max_concurrent_jobs, quota.max_input_bytes) == (3, 1000)
    assert Membership.objects.get(tenant=acme, user=bob).role == "admin"
    entries = {entry.action: entry for entry in AuditEntry.objects.filter(tenant=acme)}
    assert entries["quota.changed"].changes == {"max_concurrent_jobs": [10, 3], "max_input_bytes": [None, 1000]}
    assert entries["quota.changed"].actor == operator
    assert entries["tenant.changed"].changes == {"priority": [5, 8], "storage_prefixes": [[], ["s3://datasets/acme/"]]}
    assert entries["membership.changed"].changes["role"] == [None, "admin"]
    assert "quota of acme changed: max_concurrent_jobs, max_input_bytes" in entries["quota.changed"].summary


def test_a_member_removed_in_the_tenant_form_is_audited(admin_client: Client, acme: Tenant) -> None:
    MembershipFactory(tenant=acme, user=UserFactory(username="carol"), role="viewer")
    url = f"/admin/tenancy/tenant/{acme.pk}/change/"
    data = _change_form_data(admin_client.get(url))
    data["memberships-0-DELETE"] = "on"
    assert admin_client.post(url, data).status_code == 302
    assert not Membership.objects.filter(tenant=acme).exists()
    (entry,) = AuditEntry.objects.filter(action="membership.changed")
    assert entry.changes == {"user": ["carol", None], "tenant": ["acme", None], "role": ["viewer", None]}
    assert entry.summary.startswith("membership carol in acme (viewer) deleted")


def test_an_unchanged_tenant_form_writes_no_audit_entry(admin_client: Client, acme: Tenant) -> None:
    url = f"/admin/tenancy/tenant/{acme.pk}/change/"
    assert admin_client.post(url, _change_form_data(admin_client.get(url))).status_code == 302
    assert not AuditEntry.objects.exists()


def test_the_tenant_list_shows_priority_and_storage_prefixes(admin_client: Client, acme: Tenant) -> None:
    Tenant.objects.filter(pk=acme.pk).update(storage_prefixes=["s3://datasets/acme/"])
    page = admin_client.get("/admin/tenancy/tenant/")
    assert b"s3://datasets/acme/" in page.content
    assert b"column-priority" in page.content


def test_a_model_change_in_the_catalog_admin_is_audited_with_old_and_new_values(
    admin_client: Client, operator: User, minilm: Model
) -> None:
    url = f"/admin/catalog/model/{minilm.pk}/change/"
    data = _change_form_data(admin_client.get(url))
    data.update({"gpus_per_replica": 2, "enabled": False})
    assert admin_client.post(url, data).status_code == 302
    (entry,) = AuditEntry.objects.filter(action="model.changed")
    assert entry.changes == {"gpus_per_replica": [1, 2], "enabled": [True, False]}
    assert (entry.actor, entry.target_type, entry.target_id) == (operator, "catalog.model", str(minilm.pk))
    page = admin_client.get("/admin/catalog/gpuclass/")
    assert b"column-model_count" in page.content


def test_the_audit_log_is_read_only_and_filterable(admin_client: Client, operator: User, acme: Tenant) -> None:
    entry = audit_record(actor=operator, action="quota.changed", target=acme, tenant=acme, changes={"x": [1, 2]})
    audit_record(actor=None, action="job.cancelled", target=acme)

    listed = admin_client.get("/admin/audit/auditentry/", {"action": "quota.changed"})
    assert [e.pk for e in listed.context["cl"].result_list] == [entry.pk]
    assert admin_client.get("/admin/audit/auditentry/", {"tenant__id__exact": acme.pk}).status_code == 200
    assert admin_client.get("/admin/audit/auditentry/", {"q": "root"}).status_code == 200
    detail = admin_client.get(f"/admin/audit/auditentry/{entry.pk}/change/")
    assert detail.status_code == 200
    assert b'name="_save"' not in detail.content
    assert admin_client.get("/admin/audit/auditentry/add/").status_code == 403
    assert admin_client.post(f"/admin/audit/auditentry/{entry.pk}/change/", {"summary": "x"}).status_code == 403
    assert admin_client.post(f"/admin/audit/auditentry/{entry.pk}/delete/", {"post": "yes"}).status_code == 403
    assert AuditEntry.objects.get(pk=entry.pk).summary == ""
    assert AuditEntry.objects.filter(actor_label="system").count() == 1


def test_cli_cancel_names_the_actor_given_and_refuses_an_unknown_one(
    operator: User, acme: Tenant, minilm: Model
) -> None:
    job = _job(acme, minilm)
    with pytest.raises(CommandError, match="no user named 'nobody'"):
        call_command("job", "cancel", str(job.pk), "--actor", "nobody", stdout=io.StringIO())
    call_command("job", "cancel", str(job.pk), "--actor", "root", stdout=io.StringIO())
    assert AuditEntry.objects.get(action="job.cancelled").actor == operator


# The fleet.


@pytest.fixture
def heartbeat(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A live slot's heartbeat in Redis, as the launcher's environment makes its worker write it."""
    host = f"test-host-{uuid.uuid4().hex[:8]}"
    slot = Slot(index=0, gpu_class="h100-80gb", gpus=(2,), torch_threads=0)
    for name, value in worker_env(slot, {}, hostname=host).items():
        monkeypatch.setenv(name, value)
    beat = {**slot_heartbeat(), "host": host, "loaded_models": ["all-MiniLM-L6-v2@1"], "current_shard": "job-1/3"}
    key = heartbeat_key(host, "0")
    assert key.startswith(FLEET_KEY_PREFIX)
    beats_write({key: beat}, ttl_s=60)
    try:
        yield beat
    finally:
        beats_clear([key])
        redis_client().delete(draining_key(beat["worker"]))


def test_a_heartbeat_names_the_worker_and_queue_the_launcher_gave_its_slot(heartbeat: dict[str, Any]) -> None:
    assert heartbeat["worker"] == f"slot0-h100-80gb@{heartbeat['host']}"
    assert heartbeat["queue"] == "gpu.h100-80gb"


def test_the_fleet_is_listed_under_ops_in_the_admin_index(admin_client: Client) -> None:
    index = admin_client.get("/admin/")
    assert index.status_code == 200
    assert f'href="{FLEET_URL}"'.encode() in index.content
    assert b">Fleet<" in index.content


def test_the_fleet_page_lists_each_slot_with_a_drain_button(admin_client: Client, heartbeat: dict[str, Any]) -> None:
    page = admin_client.get(FLEET_URL)
    assert page.status_code == 200
    (row,) = [slot for slot in page.context["slots"] if slot["host"] == heartbeat["host"]]
    assert row["draining"] is False
    assert 0 <= row["age_s"] < 60
    html = page.content.decode()
    for text in (heartbeat["host"], heartbeat["worker"], "h100-80gb", "all-MiniLM-L6-v2@1", "job-1/3", "taking shards"):
        assert text in html
    assert f'<input type="hidden" name="worker" value="{heartbeat["worker"]}">' in html
    assert "csrfmiddlewaretoken" in html


def test_a_large_fleet_in_the_admin_shows_a_line_per_class_and_a_page_of_hosts(admin_client: Client) -> None:
    prefix = f"rack-{uuid.uuid4().hex[:6]}-"
    gpu_class = f"{prefix}class"
    hosts = [f"{prefix}{n:02d}" for n in range(FLEET_HOSTS_PER_PAGE + 1)]
    beats = dict(
        slot_beat(host=host, slot=0, gpu_class=gpu_class, worker=f"slot0-{gpu_class}@{host}") for host in hosts
    )
    beats_write(beats, ttl_s=60)
    drained = draining_key(f"slot0-{gpu_class}@{hosts[0]}")
    redis_client().set(drained, "1", ex=60)
    try:
        pages = [admin_client.get(FLEET_URL), admin_client.get(f"{FLEET_URL}?page=2")]
    finally:
        beats_clear(beats)
        redis_client().delete(drained)

    shown = [[host.host for host in page.context["hosts_page"] if host.host.startswith(prefix)] for page in pages]
    assert sorted(shown[0] + shown[1]) == hosts
    assert len(list(pages[0].context["hosts_page"])) == FLEET_HOSTS_PER_PAGE
    (line,) = [line for line in pages[0].context["classes"] if line.gpu_class == gpu_class]
    assert (line.hosts, line.slots, line.busy, line.draining) == (len(hosts), len(hosts), 0, 1)
    assert f"<td>{gpu_class}</td>" in pages[0].content.decode() and "?page=2" in pages[0].content.decode()


def test_drain_posts_to_the_service_with_the_queue_of_the_slots_heartbeat(
    admin_client: Client, operator: User, heartbeat: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("portal.ops.admin.slot_drain", lambda **kwargs: calls.append(kwargs) or True)

    assert admin_client.get(DRAIN_URL).status_code == 405
    response = admin_client.post(DRAIN_URL, {"worker": heartbeat["worker"], "queue": "gpu.other"}, follow=True)
    assert calls == [{"worker": heartbeat["worker"], "queue": "gpu.h100-80gb", "actor": operator}]
    assert f"{heartbeat['worker']} drained" in _messages(response)[0]

    response = admin_client.post(DRAIN_URL, {"worker": "slot9-x@nowhere"}, follow=True)
    assert _messages(response) == ["no live slot run by worker 'slot9-x@nowhere'"]
    assert len(calls) == 1


def test_the_drain_is_refused_to_staff_without_the_drain_permission(db: None, heartbeat: dict[str, Any]) -> None:
    staff = UserFactory(username="staff", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get(FLEET_URL).status_code == 403
    assert client.post(DRAIN_URL, {"worker": heartbeat["worker"]}).status_code == 403
    anonymous = Client().post(DRAIN_URL, {"worker": heartbeat["worker"]})
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]


def test_slot_drain_marks_the_slot_draining_and_audits_it_once_the_worker_confirms(
    admin_client: Client, operator: User, heartbeat: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.app import app

    worker = heartbeat["worker"]
    sent: list[tuple[str, Any]] = []

    def cancel_consumer(queue: str, destination: list[str], **kwargs: Any) -> list[dict[str, Any]]:
        sent.append((queue, destination))
        return [{worker: {"ok": f"no longer consuming from {queue}"}}] if kwargs.get("reply") else []

    monkeypatch.setattr(app.control, "cancel_consumer", cancel_consumer)
    assert slot_drain(worker=worker, queue="gpu.h100-80gb", actor=operator)
    # Its own queue too, where the scheduler sends it the shards of the adapters it holds.
    assert sent == [("gpu.h100-80gb", [worker]), (slot_own_queue("gpu.h100-80gb", worker), [worker])]
    (row,) = [slot for slot in admin_client.get(FLEET_URL).context["slots"] if slot["worker"] == worker]
    assert row["draining"] is True
    (entry,) = AuditEntry.objects.filter(action="slot.drained")
    assert (entry.actor, entry.target_type, entry.target_id) == (operator, "slot", worker)

    monkeypatch.setattr(app.control, "cancel_consumer", lambda *args, **kwargs: [])
    assert not slot_drain(worker="slot9-x@nowhere", queue="gpu.x", actor=operator)
    assert AuditEntry.objects.filter(action="slot.drained").count() == 1
    assert not redis_client().exists(draining_key("slot9-x@nowhere"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_drained_worker_stops_consuming_its_queue(operator: User, tmp_path: Path) -> None:
    from tasks.app import app

    name = f"drain-{uuid.uuid4().hex[:8]}"
    queue = f"gpu.{name}"
    worker = start_worker(name, queue, env=dict(os.environ), log_dir=ARTIFACTS / "logs")
    try:
        wait_until_consuming([worker], timeout_s=60)

        def queues() -> set[str]:
            replies = app.control.inspect([worker.hostname], timeout=2).active_queues() or {}
            return {q["name"] for q in replies.get(worker.hostname, [])}

        assert queue in queues()
        assert slot_drain(worker=worker.hostname, queue=queue, actor=operator)
        deadline = time.monotonic() + 20
        while queue in queues():
            assert time.monotonic() < deadline, f"still consuming {queue}:\n{worker.log_tail()}"
            time.sleep(0.5)
        assert worker.process.poll() is None, "draining leaves the worker running"
        assert redis_client().exists(draining_key(worker.hostname))
    finally:
        worker.stop()
        redis_client().delete(draining_key(worker.hostname))
