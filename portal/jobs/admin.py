"""Jobs in the admin: find them (filters, search), cancel, retry or re-run them; shards read-only; the ledger
read-only, with a month's chargeback as CSV."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html

from portal.audit.admin import admin_actor
from portal.jobs.chargeback import chargeback_rows, chargeback_write, parse_month
from portal.jobs.models import Job, JobUsage, Shard
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import SubmissionError
from portal.jobs.services.pause import CannotPause, job_pause, job_resume
from portal.jobs.services.rerun import job_rerun
from portal.jobs.services.retry import CannotRetry, job_retry
from portal.jobs.services.stop import CannotStop, job_cancel
from tasks.shared.storage import StorageError

SHARD_FIELDS = (
    "index",
    "round",
    "status",
    "record_count",
    "succeeded_records",
    "failed_records",
    "attempt",
    "worker",
    "started_at",
    "finished_at",
    "load_seconds",
    "compute_seconds",
)


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    can_delete = False
    show_change_link = True
    fields = SHARD_FIELDS
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "tenant",
        "model",
        "status",
        "total_records",
        "succeeded_records",
        "failed_records",
        "created_at",
    ]
    list_filter = ["status", "tenant", "model", "created_at"]
    list_select_related = ["tenant", "model"]
    search_fields = ["id", "input_uri", "tenant__name"]
    date_hierarchy = "created_at"
    readonly_fields = [field.name for field in Job._meta.fields]
    inlines = [ShardInline]
    actions = ["cancel_jobs", "pause_jobs", "resume_jobs", "retry_jobs", "rerun_jobs"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Jobs come from submissions (CLI, API, portal), which check the input and the quota.
        return False

    @admin.action(description="Cancel selected jobs", permissions=["change"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        for job in queryset:
            try:
                cancelled = job_cancel(job=job, actor=admin_actor(request))
            except CannotStop as exc:
                self.message_user(request, f"not cancelled: {exc}", messages.WARNING)
            else:
                self.message_user(request, f"job {job.id}: {cancelled.status}", messages.SUCCESS)

    @admin.action(description="Pause selected jobs", permissions=["change"])
    def pause_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._pause_or_resume(request, queryset, job_pause, "not paused")

    @admin.action(description="Resume selected jobs", permissions=["change"])
    def resume_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._pause_or_resume(request, queryset, job_resume, "not resumed")

    def _pause_or_resume(
        self, request: HttpRequest, queryset: QuerySet[Job], change: Callable[..., Job], refused: str
    ) -> None:
        for job in queryset:
            try:
                changed = change(job=job, actor=admin_actor(request))
            except CannotPause as exc:
                self.message_user(request, f"{refused}: {exc}", messages.WARNING)
            else:
                self.message_user(request, f"job {job.id}: {changed.status}", messages.SUCCESS)

    @admin.action(description="Retry failed shards of selected jobs", permissions=["change"])
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        for job in queryset:
            try:
                retried = job_retry(job=job, actor=admin_actor(request))
            except (CannotRetry, QuotaExceeded) as exc:
                self.message_user(request, f"not retried: {exc}", messages.WARNING)
            except StorageError as exc:
                self.message_user(request, f"job {job.id} not retried: its errors file: {exc}", messages.ERROR)
            else:
                self.message_user(
                    request, f"job {job.id}: {retried.status}, retry round {retried.retry_round}", messages.SUCCESS
                )

    @admin.action(description="Re-run selected jobs", permissions=["change"])
    def rerun_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        for job in queryset.select_related("tenant", "model"):
            try:
                rerun = job_rerun(job=job, actor=admin_actor(request))
            except SubmissionError as exc:
                self.message_user(request, f"job {job.id} not re-run: {exc.message}", messages.WARNING)
            else:
                link = reverse("admin:jobs_job_change", args=[rerun.pk])
                self.message_user(
                    request,
                    format_html('job {} re-run as <a href="{}">job {}</a>', job.id, link, rerun.id),
                    messages.SUCCESS,
                )


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = [
        "job",
        "index",
        "round",
        "status",
        "record_count",
        "attempt",
        "worker",
        "started_at",
        "load_seconds",
        "compute_seconds",
    ]
    list_filter = ["status"]
    list_select_related = ["job"]
    search_fields = ["job__id", "worker"]
    readonly_fields = [field.name for field in Shard._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(JobUsage)
class JobUsageAdmin(admin.ModelAdmin):
    """The ledger, read-only: it is written when jobs end."""

    list_display = ["job", "round", "tenant", "model", "period", "status", "records_succeeded", "gpu_seconds"]
    list_filter = ["period", "tenant", "model"]
    list_select_related = ["tenant", "model"]
    readonly_fields = [field.name for field in JobUsage._meta.fields]

    def get_urls(self) -> list[URLPattern]:
        chargeback = path(
            "chargeback.csv", self.admin_site.admin_view(self.chargeback_view), name="jobs_jobusage_chargeback"
        )
        return [chargeback, *super().get_urls()]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def chargeback_view(self, request: HttpRequest) -> HttpResponse:
        """`?month=YYYY-MM`: the month's chargeback as a CSV download, for those who may view the ledger."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            month = parse_month(request.GET.get("month", ""))
        except ValueError as exc:
            return HttpResponseBadRequest(str(exc), content_type="text/plain")
        response = HttpResponse(content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="chargeback-{month:%Y-%m}.csv"'
        chargeback_write(chargeback_rows(month=month), response)
        return response
