"""/api/v1/jobs/{id}/rerun/ and /api/v1/jobs/{id}/comparison/: re-run a job with changes, and the re-run's
comparison report against the job it re-runs. A mixin of the job view set, which scopes the jobs."""

from __future__ import annotations

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from portal.api.access import request_user
from portal.api.errors import conflict, submission_refused
from portal.api.serializers import JobSerializer, ParamsField
from portal.jobs.requests import SubmissionError
from portal.jobs.services.comparison import ComparisonNotReady, ComparisonPending, NotARerun, job_comparison_read
from portal.jobs.services.rerun import RerunChanges, job_rerun


class RerunSerializer(serializers.Serializer):
    model = serializers.CharField(
        max_length=200, required=False, help_text="Another catalog model of the same task; omitted: the job's own."
    )
    model_version = serializers.CharField(
        max_length=50, required=False, help_text="A version of the model; omitted: the job's (or the newest)."
    )
    params = ParamsField(
        required=False,
        help_text="Merged over the job's params: a key given replaces the job's value, a null removes it.",
    )

    def validate_params(self, value: Any) -> Any:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object")
        return value

    def changes(self) -> RerunChanges:
        data = self.validated_data
        return RerunChanges(
            model_name=data.get("model"), model_version=data.get("model_version"), params=data.get("params")
        )


class ComparisonPendingSerializer(serializers.Serializer):
    status = serializers.CharField(help_text='"computing".')
    detail = serializers.CharField(help_text="What is being compared.")


RETRY_AFTER_S = 30
"""What a 202 for a comparison being written asks the client to wait."""


class JobRerunActions:
    """The job view set's `rerun` and `comparison` actions."""

    get_object: Any

    @extend_schema(
        request=RerunSerializer,
        responses={
            201: JobSerializer,
            400: OpenApiResponse(description="Invalid changes; `error.fields` names the field."),
            404: OpenApiResponse(description="No such job in your tenant."),
            429: OpenApiResponse(description="A quota refuses the new job."),
        },
    )
    @action(detail=True, methods=["post"])
    def rerun(self, request: Request, pk: str) -> Response:
        """Run the job's input again as a new job, with another `model`, `model_version` or `params` (merged
        over the job's); the new job's `rerun_of` names this one, and its comparison report is at
        `GET /jobs/{new id}/comparison/` once both have ended."""
        job = self.get_object()
        form = RerunSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            rerun = job_rerun(job=job, actor=request_user(request), changes=form.changes())
        except SubmissionError as exc:
            raise submission_refused(exc) from None
        return Response(JobSerializer(rerun, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=None,
        responses={
            200: OpenApiResponse(OpenApiTypes.OBJECT, description="The comparison report (docs/api.md)."),
            202: OpenApiResponse(
                ComparisonPendingSerializer,
                description="Being written by the comparison task (a large re-run); ask again after Retry-After.",
            ),
            404: OpenApiResponse(description="No such job in your tenant, or the job is no re-run."),
            409: OpenApiResponse(description="Not ready: a job has not ended, or has no output to compare."),
        },
    )
    @action(detail=True, methods=["get"])
    def comparison(self, request: Request, pk: str) -> Response:
        """The re-run's comparison with the job it re-runs, made once both have succeeded (or partially
        succeeded) and kept beside its output as `comparison.json`."""
        try:
            return Response(job_comparison_read(job=self.get_object()))
        except ComparisonPending as exc:
            pending = {"status": "computing", "detail": str(exc)}
            return Response(pending, status=status.HTTP_202_ACCEPTED, headers={"Retry-After": str(RETRY_AFTER_S)})
        except NotARerun as exc:
            raise NotFound(str(exc)) from None
        except ComparisonNotReady as exc:
            raise conflict(str(exc)) from None
