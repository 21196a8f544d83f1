"""Jobs: the dashboard, the submit form, a job's page with its live panel, cancel, retry, downloads."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.models import User
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from portal.api.downloads import stream_object, stream_partial
from portal.catalog.money import money
from portal.catalog.selectors import models_for_tenant
from portal.jobs.billing import job_cost
from portal.jobs.input_display import tenant_input_uri, tenant_job_error, tenant_manifest
from portal.jobs.models import FINAL_STATUSES, Job, JobStatus
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import SubmissionError
from portal.jobs.selectors import job_output_file
from portal.jobs.services.dry_run import DryRunReport, job_dry_run
from portal.jobs.services.input_access import tenant_input_roots
from portal.jobs.services.partial import OFFERED_STATUSES, job_partial_output
from portal.jobs.services.pause import CannotPause, job_pause, job_resume
from portal.jobs.services.retry import CannotRetry, job_retry, job_retryable
from portal.jobs.services.stop import CannotStop, job_cancel
from portal.jobs.services.submit import job_submit
from portal.jobs.services.uploads import UploadTooLarge, upload_store
from portal.tenancy.models import Membership
from portal.web.access import PortalAccess, page, refused, tenant_view
from portal.web.forms import SubmitForm
from portal.web.selectors import (
    error_lines,
    job_adapters,
    job_row,
    job_rows,
    job_timeline,
    quota_use,
    shard_grid,
    tenant_jobs,
    throughput_history,
)
from portal.web.views.reruns import rerun_context
from tasks.shared.storage import StorageError, store_for

JOBS_PER_PAGE = 25
CANCELLABLE = frozenset({JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.PAUSED})
ADVANCED_FIELDS = frozenset(
    {"shard_size", "input_format", "text_column", "id_column", "output_format", "deadline_seconds", "priority"}
)
# Where a refusal from `job_submit` belongs on the form (the service names `format`, the form `input_format`).
REFUSAL_FIELDS = {"format": "input_format", **{name: name for name in ADVANCED_FIELDS | {"model", "params"}}}


def _user(request: HttpRequest) -> User | None:
    return request.user if isinstance(request.user, User) else None


def _dashboard_context(request: HttpRequest, portal: PortalAccess) -> dict[str, Any]:
    jobs = Paginator(tenant_jobs(portal.tenant), JOBS_PER_PAGE).get_page(request.GET.get("page"))
    rows = job_rows(jobs)
    return {
        "rows": rows,
        "jobs_page": jobs,
        "quota": quota_use(portal.tenant),
        # Poll every second while something runs; slowly otherwise, so new jobs still show up.
        "poll": "1s" if any(row.job.status not in FINAL_STATUSES for row in rows) else "5s",
    }


@tenant_view()
def dashboard(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    return page(request, portal, "web/dashboard.html", _dashboard_context(request, portal))


@tenant_view()
def dashboard_live(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    """The dashboard's live part (quota cards and the jobs table), polled by htmx."""
    return page(request, portal, "web/_dashboard_live.html", _dashboard_context(request, portal))


def _store_input(portal: PortalAccess, form: SubmitForm) -> tuple[str, bool]:
    """The input URI to submit, and whether it is an upload this request stored."""
    upload = form.cleaned_data.get("file")
    if upload is None:
        return form.cleaned_data["input_uri"].strip(), False
    uri, _ = upload_store(tenant_id=portal.tenant.pk, filename=upload.name or "input.jsonl", chunks=upload.chunks())
    return uri, True


def _submit(request: HttpRequest, portal: PortalAccess, form: SubmitForm) -> Job:
    input_uri, uploaded = _store_input(portal, form)
    try:
        return job_submit(
            tenant=portal.tenant,
            request=form.job_request(input_uri),
            user=_user(request),
            input_roots=tenant_input_roots(portal.tenant),
        )
    except SubmissionError:
        if uploaded:
            # A refused job keeps nothing: the upload goes with it.
            store_for(input_uri).delete_prefix(input_uri)
        raise


def _check(portal: PortalAccess, form: SubmitForm) -> DryRunReport:
    """A dry run of the form's request: an upload is kept only while it is read."""
    input_uri, uploaded = _store_input(portal, form)
    try:
        return job_dry_run(
            tenant=portal.tenant, request=form.job_request(input_uri), input_roots=tenant_input_roots(portal.tenant)
        )
    finally:
        if uploaded:
            store_for(input_uri).delete_prefix(input_uri)


@tenant_view(role=Membership.Role.MEMBER)
def submit(request: HttpRequest, portal: PortalAccess) -> HttpResponse:
    """The submit form; its "Check first" button (`action=check`) shows a dry run's report instead."""
    models = models_for_tenant(portal.tenant).order_by("name", "-version")
    form = SubmitForm(request.POST or None, request.FILES or None, models=models)
    refusal: SubmissionError | None = None
    report: DryRunReport | None = None
    if request.method == "POST" and form.is_valid():
        try:
            if request.POST.get("action") == "check":
                report = _check(portal, form)
            else:
                return redirect("web:job", job_id=_submit(request, portal, form).pk)
        except UploadTooLarge as exc:
            form.add_error("file", str(exc))
        except SubmissionError as exc:
            refusal = exc
    refused_field = REFUSAL_FIELDS.get(refusal.field, "") if refusal else ""
    if refusal and refused_field:
        form.add_error(refused_field, refusal.message)
    context = {
        "form": form,
        "models": list(models),
        "refusal": _refusal(refusal) if refusal else None,
        "report": report,
        # A browser does not keep a chosen file across pages: after a check it must be chosen again.
        "choose_again": report is not None and bool(form.cleaned_data.get("file")),
        "max_upload": settings.BATCHERY_MAX_UPLOAD_BYTES,
        "advanced_open": refused_field in ADVANCED_FIELDS or any(form.has_error(name) for name in ADVANCED_FIELDS),
    }
    failed = request.method == "POST" and report is None
    return page(request, portal, "web/submit.html", context, status=400 if failed else 200)


@dataclass(frozen=True)
class Refusal:
    """A refused submission as the form shows it: a headline, then each bad line on its own."""

    headline: str
    problems: list[tuple[str, str]]
    """(where, what): "line 2" or "row 2" (empty for the whole file), and the message."""
    more: str
    """"and 5 more bad lines" when more were found than listed."""
    quota: bool


def _refusal(exc: SubmissionError) -> Refusal:
    # The service's message lists the problems inline ("input rejected: 2 bad lines: line 2: …; line 4: …");
    # the form lists them one per row instead, so only the part before the first is the headline.
    problems = [(str(problem)[: -len(problem.message)].rstrip(": "), problem.message) for problem in exc.problems]
    headline, more = exc.message, ""
    if exc.problems:
        headline = exc.message.split(f": {exc.problems[0]}", 1)[0]
        if "; and " in exc.message:
            more = "and " + exc.message.rsplit("; and ", 1)[1]
    return Refusal(headline=headline, problems=problems, more=more, quota=isinstance(exc, QuotaExceeded))


def _job(portal: PortalAccess, job_id: uuid.UUID) -> Job:
    """The job if it is the tenant's; 404 otherwise, the same as for a job that does not exist."""
    return get_object_or_404(tenant_jobs(portal.tenant), pk=job_id)


def _job_context(portal: PortalAccess, job: Job) -> dict[str, Any]:
    member = portal.allows(Membership.Role.MEMBER)
    return {
        "job": job,
        "input_uri": tenant_input_uri(job),
        "job_error": tenant_job_error(job),
        "manifest": tenant_manifest(job.provenance, job=job) if job.provenance else {},
        "adapters": job_adapters(job),
        "row": job_row(job),
        "cost": money(job_cost(job)),
        "timeline": job_timeline(job),
        "shards": shard_grid(job),
        "errors": error_lines(job),
        # An ended job's chart comes from its shards' timings; a running one's from the polls.
        "history_json": json.dumps(throughput_history(job) if job.is_finished else []),
        "can_cancel": member and job.status in CANCELLABLE,
        "can_pause": member and job.status == JobStatus.RUNNING,
        "can_resume": member and job.status == JobStatus.PAUSED,
        "can_retry": member and job_retryable(job, now=timezone.now()),
        "downloads": job.is_finished and job.shard_count > 0,
        "partial_download": job.status in OFFERED_STATUSES,
        "sampled_at": time.time(),
    }


@tenant_view()
def job_detail(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    job = _job(portal, job_id)
    return page(request, portal, "web/job.html", {**_job_context(portal, job), **rerun_context(portal, job)})


@tenant_view()
def job_live(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    """The job page's live panel, polled by htmx every second until the job has ended."""
    return page(request, portal, "web/_job_live.html", _job_context(portal, _job(portal, job_id)))


def _job_action(
    request: HttpRequest,
    portal: PortalAccess,
    job_id: uuid.UUID,
    act: Callable[..., object],
    refused: type[Exception] | tuple[type[Exception], ...],
    done: str,
) -> HttpResponse:
    """Run one of the job's actions; say what it did, or why it was refused, on the job's page."""
    job = _job(portal, job_id)
    try:
        act(job=job, actor=_user(request))
    except refused as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, done)
    return redirect("web:job", job_id=job.pk)


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def job_cancel_view(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    done = "Cancelling: running shards stop at their next batch; finished work is kept."
    return _job_action(request, portal, job_id, job_cancel, CannotStop, done)


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def job_pause_view(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    done = "Paused: no new shard starts; running shards finish. The deadline keeps running."
    return _job_action(request, portal, job_id, job_pause, CannotPause, done)


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def job_resume_view(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    return _job_action(request, portal, job_id, job_resume, CannotPause, "Resumed.")


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def job_retry_view(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    done = f"Retrying the {_job(portal, job_id).failed_records:,} failed records."
    return _job_action(request, portal, job_id, job_retry, (CannotRetry, QuotaExceeded), done)


@tenant_view()
def job_download(
    request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID, name: str
) -> HttpResponse | StreamingHttpResponse:
    """Stream the job's output or errors file (only the tenant's jobs, only once they have ended)."""
    job = _job(portal, job_id)
    if not job.is_finished or not job.shard_count:
        return refused(request, portal, f"Job {job.pk} is {job.status}; its files exist once it has ended.", status=409)
    uri, filename = job_output_file(job) if name == "output" else (job.errors_uri, "errors.jsonl")
    content_type = "application/vnd.apache.parquet" if filename.endswith(".parquet") else "application/jsonl"
    try:
        return stream_object(uri, filename=f"{job.pk}-{filename}", content_type=content_type)
    except StorageError as exc:
        return refused(request, portal, f"The {name} file of job {job.pk} cannot be read: {exc}", status=409)


@tenant_view()
def job_partial_download(
    request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID
) -> HttpResponse | StreamingHttpResponse:
    """Stream the records of the job's shards committed so far, as `?partial=true` on the API does."""
    job = _job(portal, job_id)
    try:
        return stream_partial(job_partial_output(job), filename=f"{job.pk}-output.partial.jsonl")
    except StorageError as exc:
        return refused(request, portal, f"The partial output of job {job.pk} cannot be read: {exc}", status=409)
