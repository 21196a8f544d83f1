"""/api/v1/jobs/: submit (upload or URI), list with filters, read with live progress, cancel, retry, download."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.access import request_access, request_user
from portal.api.downloads import DOWNLOAD_RENDERERS, stream_object, stream_partial
from portal.api.dry_run_serializers import DryRunReportSerializer
from portal.api.errors import conflict, submission_refused
from portal.api.filters import JobFilter
from portal.api.parsers import JSONParser
from portal.api.scoping import TenantScopedMixin
from portal.api.serializers import JobCreateSerializer, JobSerializer
from portal.api.uploads import store_upload
from portal.api.usage_serializers import JobCostSerializer, money_field
from portal.api.views.job_rerun import JobRerunActions
from portal.jobs.billing import job_cost
from portal.jobs.input_display import tenant_manifest
from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import SubmissionError
from portal.jobs.selectors import job_output_file, jobs_live_progress
from portal.jobs.services.dry_run import job_dry_run
from portal.jobs.services.input_access import tenant_input_roots
from portal.jobs.services.partial import job_partial_output
from portal.jobs.services.pause import CannotPause, job_pause, job_resume
from portal.jobs.services.retry import CannotRetry, job_retry
from portal.jobs.services.stop import CannotStop, job_cancel
from portal.jobs.services.submit import job_submit
from tasks.shared.storage import StorageError, presigned_url, store_for

DOWNLOAD_URLS = inline_serializer(
    "DownloadUrls",
    {
        "output": serializers.URLField(),
        "errors": serializers.URLField(),
        "presigned": serializers.BooleanField(help_text="True: links straight to storage, for `expires_in` seconds."),
        "expires_in": serializers.IntegerField(),
    },
)
PARTIAL_HEADERS = [
    OpenApiParameter(name, kind, OpenApiParameter.HEADER, description=f"With `partial`: {what}.", response=[200])
    for name, kind, what in (
        ("X-Batchery-Partial-Shards", int, "the shards whose records it holds, from the first"),
        ("X-Batchery-Partial-Records", int, "its lines, one per record of those shards"),
        ("X-Batchery-Partial-Complete", bool, "`true` when it is the final output (the job has ended)"),
    )
]
ERROR_RESPONSES = {
    400: OpenApiResponse(description="Invalid request; `error.fields` and `error.lines` name the problems."),
    401: OpenApiResponse(description="No valid API key or session."),
    403: OpenApiResponse(description="Your role does not allow this."),
    404: OpenApiResponse(description="No such job in your tenant."),
}


class OutputQuerySerializer(serializers.Serializer):
    def get_fields(self) -> dict[str, serializers.Field]:
        # Not a class attribute: there, `partial` would take the place of the serializer's own flag.
        return {
            "partial": serializers.BooleanField(
                required=False,
                default=False,
                help_text=(
                    "`true`: the records of the shards committed so far, from the first up to the first "
                    "one not done, as JSONL whatever the output format; an ended job's whole output."
                ),
            )
        }


class JobViewSet(
    TenantScopedMixin, JobRerunActions, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    queryset = Job.objects.select_related("model").all()
    serializer_class = JobSerializer
    filterset_class = JobFilter
    parser_classes = [JSONParser, MultiPartParser, FormParser]

    def get_queryset(self) -> QuerySet[Any]:
        queryset = super().get_queryset()
        if self.action in ("list", "retrieve"):
            # Of the model, a job shows its name and version: reading its other columns (JSON among them)
            # and building them took a quarter of a list page's read.
            # The provenance manifest, kilobytes a job, has its own route.
            columns = [field.name for field in Job._meta.concrete_fields if field.name != "provenance"]
            queryset = queryset.only(*columns, "model__name", "model__version")
        return queryset

    def filter_queryset(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # The filters narrow the list. A job named by its id is found whatever the query string says, and
        # building the filter set for it took a fifth of a status request's time; a list asked without
        # any filter is not narrowed, and building the filter set for it took a tenth of the page's.
        if self.action != "list" or not any(name in self.request.query_params for name in JobFilter.base_filters):
            return queryset
        return super().filter_queryset(queryset)

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        # The page's live progress in one Redis round trip, not one per running job.
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        if page is None:
            return super().list(request, *args, **kwargs)
        context = {**self.get_serializer_context(), "live_progress": jobs_live_progress(page)}
        return self.get_paginated_response(JobSerializer(page, many=True, context=context).data)

    @extend_schema(
        request={"multipart/form-data": JobCreateSerializer, "application/json": JobCreateSerializer},
        responses={
            201: JobSerializer,
            200: OpenApiResponse(DryRunReportSerializer, description="With `dry_run`: what the job would do."),
            **ERROR_RESPONSES,
            413: OpenApiResponse(description="The upload is over the size limit."),
            429: OpenApiResponse(description="A quota refuses the job; `error.quota` names it, its limit and use."),
        },
    )
    def create(self, request: Request) -> Response:
        """Submit a job; with `dry_run`, report what it would do instead (bad lines and quota refusals
        included, in the report) and create nothing."""
        form = JobCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        data = form.validated_data
        access = request_access(request)
        input_field = "file" if "file" in data else "input_uri"
        input_uri = store_upload(access.tenant, data["file"]) if "file" in data else data["input_uri"]
        job_request = form.job_request(input_uri)
        roots = tenant_input_roots(access.tenant)
        if data["dry_run"]:
            try:
                report = job_dry_run(tenant=access.tenant, request=job_request, input_roots=roots)
            except SubmissionError as exc:
                raise submission_refused(exc, field=input_field if exc.field == "input" else None) from None
            finally:
                # A dry run keeps nothing: its upload goes whatever the outcome.
                if "file" in data:
                    store_for(input_uri).delete_prefix(input_uri)
            return Response(DryRunReportSerializer(report).data)
        try:
            job = job_submit(tenant=access.tenant, request=job_request, user=request_user(request), input_roots=roots)
        except SubmissionError as exc:
            if "file" in data:
                store_for(input_uri).delete_prefix(input_uri)
            raise submission_refused(exc, field=input_field if exc.field == "input" else None) from None
        return Response(JobSerializer(job, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: JobSerializer, 409: OpenApiResponse(description="Already ended.")})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        try:
            job = job_cancel(job=self.get_object(), actor=request_user(request))
        except CannotStop as exc:
            raise conflict(str(exc)) from None
        return Response(JobSerializer(job, context={"request": request}).data)

    @extend_schema(request=None, responses={200: JobSerializer, 409: OpenApiResponse(description="Not running.")})
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str) -> Response:
        """Start no new shard of the job; its running shards finish. Its deadline keeps running."""
        try:
            job = job_pause(job=self.get_object(), actor=request_user(request))
        except CannotPause as exc:
            raise conflict(str(exc)) from None
        return Response(JobSerializer(job, context={"request": request}).data)

    @extend_schema(request=None, responses={200: JobSerializer, 409: OpenApiResponse(description="Not paused.")})
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        try:
            job = job_resume(job=self.get_object(), actor=request_user(request))
        except CannotPause as exc:
            raise conflict(str(exc)) from None
        return Response(JobSerializer(job, context={"request": request}).data)

    @extend_schema(request=None, responses={200: JobSerializer, 409: OpenApiResponse(description="Nothing to retry.")})
    @action(detail=True, methods=["post"])
    def retry(self, request: Request, pk: str) -> Response:
        try:
            job = job_retry(job=self.get_object(), actor=request_user(request))
        except CannotRetry as exc:
            raise conflict(str(exc)) from None
        except QuotaExceeded as exc:
            raise submission_refused(exc) from None
        return Response(JobSerializer(job, context={"request": request}).data)

    @extend_schema(request=None, responses={200: JobCostSerializer})
    @action(detail=True, methods=["get"])
    def cost(self, request: Request, pk: str) -> Response:
        """What the job costs: its ended shards' so far while it runs, its ledger line's once it has ended.
        Apart from the job's status, which pollers read every second in a fixed few queries."""
        job = self.get_object()
        return Response(JobCostSerializer({"final": job.is_finished, "cost": money_field(job_cost(job))}).data)

    @extend_schema(
        responses={
            200: OpenApiResponse(OpenApiTypes.OBJECT, description="The job's manifest.json (docs/api.md, Provenance)."),
            409: OpenApiResponse(description="Not merged yet: the manifest is written with the output."),
        }
    )
    @action(detail=True, methods=["get"])
    def manifest(self, request: Request, pk: str) -> Response:
        """How the job's output was made: the model's weights and tokenizer by digest as its slots loaded them,
        the engine's and the software's versions, its parameters and every record's own by digest, its seed,
        its input's digest, and the GPU classes and hosts that ran it."""
        job = self.get_object()
        if not job.provenance:
            raise conflict(f"job {job.id} is {job.status}: its manifest is written when its output is merged")
        # A manifest kept before it was written in its tenant's form is read in it too.
        return Response(tenant_manifest(job.provenance, job=job))

    def _files(self, job: Job) -> dict[str, tuple[str, str]]:
        if not job.is_finished or not job.shard_count:
            raise conflict(f"job {job.id} is {job.status}; its files exist once it has ended")
        return {"output": job_output_file(job), "errors": (job.errors_uri, "errors.jsonl")}

    def _download(self, job: Job, name: str) -> StreamingHttpResponse:
        uri, filename = self._files(job)[name]
        content_type = "application/vnd.apache.parquet" if filename.endswith(".parquet") else "application/jsonl"
        try:
            return stream_object(uri, filename=f"{job.id}-{filename}", content_type=content_type)
        except StorageError as exc:
            raise conflict(f"the {name} file of job {job.id} cannot be read: {exc}") from None

    @extend_schema(
        parameters=[OutputQuerySerializer, *PARTIAL_HEADERS],
        responses={(200, "application/jsonl"): OpenApiTypes.BINARY, 409: OpenApiResponse()},
    )
    @action(detail=True, methods=["get"], renderer_classes=DOWNLOAD_RENDERERS)
    def output(self, request: Request, pk: str) -> StreamingHttpResponse:
        """The output file: one line (or Parquet row) per input record, in input order. With
        `partial=true`, at any time: the lines of the shards committed so far, a prefix of the final
        output that each later download extends, counted in the `X-Batchery-Partial-*` headers."""
        job = self.get_object()
        query = OutputQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        if not query.validated_data["partial"]:
            return self._download(job, "output")
        try:
            return stream_partial(job_partial_output(job), filename=f"{job.id}-output.partial.jsonl")
        except StorageError as exc:
            raise conflict(f"the partial output of job {job.id} cannot be read: {exc}") from None

    @extend_schema(responses={(200, "application/jsonl"): OpenApiTypes.BINARY, 409: OpenApiResponse()})
    @action(detail=True, methods=["get"], renderer_classes=DOWNLOAD_RENDERERS)
    def errors(self, request: Request, pk: str) -> StreamingHttpResponse:
        """The error file: the lines of the records that failed."""
        return self._download(self.get_object(), "errors")

    @extend_schema(responses={200: DOWNLOAD_URLS, 409: OpenApiResponse(description="Not ended yet.")})
    @action(detail=True, methods=["get"], url_path="download-urls")
    def download_urls(self, request: Request, pk: str) -> Response:
        """Links to the output and error files: presigned by the store where it can (S3), so the bytes
        go straight from storage to the client; else the API's own download links."""
        job = self.get_object()
        expires_s = settings.BATCHERY_PRESIGNED_URL_EXPIRES_S
        urls: dict[str, Any] = {"expires_in": expires_s, "presigned": True}
        for name, (uri, _) in self._files(job).items():
            url = presigned_url(uri, expires_s=expires_s)
            if url is None:
                urls["presigned"] = False
                url = request.build_absolute_uri(reverse(f"api:job-{name}", kwargs={"pk": job.pk}))
            urls[name] = url
        return Response(urls)

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "request": self.request}
