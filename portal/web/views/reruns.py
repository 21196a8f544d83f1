"""The portal's re-run: the form on a job's page that re-runs it with changes, and the re-run's comparison
page (its figures and a histogram drawn server-side)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import messages
from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from portal.catalog.selectors import models_for_tenant
from portal.jobs.models import Job
from portal.jobs.requests import SubmissionError
from portal.jobs.services.comparison import ComparisonNotReady, ComparisonPending, NotARerun, job_comparison_read
from portal.jobs.services.rerun import RerunChanges, job_rerun
from portal.tenancy.models import Membership
from portal.web.access import PortalAccess, page, refused, tenant_view
from portal.web.histogram import HEIGHT, WIDTH, histogram_bars
from portal.web.selectors import tenant_jobs


def rerun_context(portal: PortalAccess, job: Job) -> dict[str, Any]:
    """What the job page's Re-run card shows: the link to the job it re-runs, its own re-runs, and for
    members the form's models (the tenant's models of the job's task). Not on the live panel's polls."""
    models = models_for_tenant(portal.tenant).filter(task=job.model.task)
    return {
        "can_rerun": portal.allows(Membership.Role.MEMBER),
        "rerun_models": sorted(set(models.values_list("name", flat=True))),
        "reruns": list(job.reruns.order_by("-created_at")[:10]),
    }


def _changes(request: HttpRequest) -> RerunChanges:
    """The form's changes; raises `SubmissionError` naming `params` where they are not a JSON object."""
    text = request.POST.get("params", "").strip()
    params = None
    if text:
        try:
            params = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SubmissionError(f"params is not JSON: {exc}", field="params") from None
        if not isinstance(params, dict):
            raise SubmissionError("params must be a JSON object", field="params")
    return RerunChanges(
        model_name=request.POST.get("model", "").strip() or None,
        model_version=request.POST.get("model_version", "").strip() or None,
        params=params,
    )


@require_POST
@tenant_view(role=Membership.Role.MEMBER)
def job_rerun_view(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    job = get_object_or_404(tenant_jobs(portal.tenant), pk=job_id)
    try:
        actor = request.user if isinstance(request.user, User) else None
        rerun = job_rerun(job=job, actor=actor, changes=_changes(request))
    except SubmissionError as exc:
        messages.error(request, f"Re-run refused ({exc.field}): {exc.message}")
        return redirect("web:job", job_id=job.pk)
    messages.success(request, f"Re-running as job {rerun.pk}; its comparison is ready once both jobs have ended.")
    return redirect("web:job", job_id=rerun.pk)


@tenant_view()
def job_comparison_view(request: HttpRequest, portal: PortalAccess, job_id: uuid.UUID) -> HttpResponse:
    job = get_object_or_404(tenant_jobs(portal.tenant), pk=job_id)
    try:
        report = job_comparison_read(job=job)
    except ComparisonPending as exc:
        return refused(request, portal, f"No comparison yet: {exc}.", status=202)
    except NotARerun as exc:
        return refused(request, portal, str(exc), status=404)
    except ComparisonNotReady as exc:
        return refused(request, portal, f"No comparison yet: {exc}.", status=409)
    figures = report.get("text") or report.get("embeddings") or {}
    distribution = figures.get("edit_distance") or figures.get("cosine")
    context = {
        "job": job,
        "report": report,
        "figures": figures,
        "distribution": distribution,
        "distribution_name": "normalised edit distance" if "text" in report else "cosine similarity",
        "bars": histogram_bars(distribution["histogram"]) if distribution else [],
        "svg_width": WIDTH,
        "svg_height": HEIGHT,
    }
    return page(request, portal, "web/comparison.html", context)
