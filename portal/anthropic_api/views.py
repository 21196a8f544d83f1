"""Anthropic's Message Batches API (`/v1/messages/batches`), so that unchanged Anthropic client code runs here.

Same keys (in `x-api-key` or `Authorization: Bearer`), same roles and quotas as `/api/v1/` and the OpenAI
layer; the views only translate, and every error comes in Anthropic's shape (`errors.py`).

A message batch is visible only through the API key that created it: the tenant's other keys get 404 for
it and do not see it in the list, as at Anthropic, where a batch belongs to its workspace and the keys of
another workspace see nothing of it (here a key stands for that workspace). Its job, a Batchery job like
any other, stays visible to the tenant through `/api/v1/jobs/` and the portal.
"""

from __future__ import annotations

from typing import Any, cast

from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.anthropic_api.authentication import XApiKeyAuthentication
from portal.anthropic_api.errors import anthropic_exception_handler, invalid_request, not_found
from portal.anthropic_api.formats.requests import ANTHROPIC_VERSIONS
from portal.anthropic_api.models import MessageBatch
from portal.anthropic_api.selectors import message_batch_object, message_batch_results, processing_status
from portal.anthropic_api.services.batches import (
    MessageBatchRefused,
    message_batch_cancel,
    message_batch_create,
    message_batch_delete,
)
from portal.api.access import request_access, request_user
from portal.api.authentication import ApiKeyAuthentication
from portal.api.downloads import DOWNLOAD_RENDERERS
from portal.api.errors import ApiError, submission_refused
from portal.api.parsers import JSONParser
from portal.jobs.quota import QuotaExceeded
from portal.jobs.services.stop import CannotStop
from portal.tenancy.models import ApiKey
from tasks.shared.storage import StorageError, TransientStorageError

TAGS = ["anthropic-message-batches"]
VERSION_HEADER = "anthropic-version"
PAGE_PARAMETERS = [
    OpenApiParameter("limit", int, description="Batches per page, 1 to 1,000 (default 20)."),
    OpenApiParameter("before_id", str, description="The page just before (newer than) this batch."),
    OpenApiParameter("after_id", str, description="The page just after (older than) this batch."),
]


class MessageBatchCreateSerializer(serializers.Serializer):
    requests = serializers.JSONField(help_text="The requests: [{custom_id, params: {Messages API params}}].")


class PageSerializer(serializers.Serializer):
    """Anthropic's paging: newest first, up to 1,000 a page, before or after a batch's id."""

    limit = serializers.IntegerField(required=False, min_value=1, max_value=1000, default=20)
    before_id = serializers.CharField(required=False, max_length=60)
    after_id = serializers.CharField(required=False, max_length=60)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("before_id") and attrs.get("after_id"):
            raise serializers.ValidationError({"before_id": ["give before_id or after_id, not both"]})
        return attrs


class MessageBatchesApiView(APIView):
    """The base of every view here: its key schemes, the version check, the scoping and the error shape."""

    authentication_classes = [XApiKeyAuthentication, ApiKeyAuthentication]
    parser_classes = [JSONParser]

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        version = request.headers.get(VERSION_HEADER)
        if version not in ANTHROPIC_VERSIONS:
            given = "is missing" if version is None else f"is {version!r}"
            raise invalid_request(
                f"{VERSION_HEADER}: the header {given}; the versions served are {', '.join(ANTHROPIC_VERSIONS)}"
            )
        super().initial(request, *args, **kwargs)

    def get_exception_handler(self) -> Any:
        return anthropic_exception_handler

    def batches(self, request: Request) -> QuerySet[MessageBatch]:
        """The batches the request's key created (see the module's docstring)."""
        return MessageBatch.objects.select_related("job__model").filter(
            tenant=request_access(request).tenant, api_key=cast(ApiKey, request.auth)
        )

    def batch(self, request: Request, batch_id: str) -> MessageBatch:
        batch = self.batches(request).prefetch_related("job__events").filter(pk=batch_id).first()
        if batch is None:
            raise not_found(batch_id)
        return batch


def _refused(exc: MessageBatchRefused) -> ApiError:
    return invalid_request(str(exc))


class MessageBatchesView(MessageBatchesApiView):
    @extend_schema(
        operation_id="listMessageBatches", tags=TAGS, parameters=PAGE_PARAMETERS, responses=OpenApiTypes.OBJECT
    )
    def get(self, request: Request) -> Response:
        query = PageSerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        limit, before_id, after_id = (query.validated_data.get(name) for name in ("limit", "before_id", "after_id"))
        batches = self.batches(request).prefetch_related("job__events")
        anchor_id = before_id or after_id
        if anchor_id:
            anchor = batches.filter(pk=anchor_id).values("created_at", "id").first()
            if anchor is None:
                raise not_found(anchor_id)
            if before_id:
                # The page just newer than the anchor: read from the anchor up, shown newest first.
                newer = batches.filter(created_at__gte=anchor["created_at"]).exclude(pk=anchor_id)
                newer = newer.exclude(created_at=anchor["created_at"], id__lt=anchor["id"])
                rows = list(newer.order_by("created_at", "id")[: limit + 1])
                has_more = len(rows) > limit
                rows = rows[:limit][::-1]
            else:
                older = batches.filter(created_at__lte=anchor["created_at"]).exclude(pk=anchor_id)
                older = older.exclude(created_at=anchor["created_at"], id__gt=anchor["id"])
                rows = list(older.order_by("-created_at", "-id")[: limit + 1])
                has_more = len(rows) > limit
                rows = rows[:limit]
        else:
            rows = list(batches.order_by("-created_at", "-id")[: limit + 1])
            has_more = len(rows) > limit
            rows = rows[:limit]
        data = [message_batch_object(batch, request=request) for batch in rows]
        return Response(
            {
                "data": data,
                "has_more": has_more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )

    @extend_schema(
        operation_id="createMessageBatch",
        tags=TAGS,
        request=MessageBatchCreateSerializer,
        responses={200: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request) -> Response:
        body = request.data
        if not isinstance(body, dict) or "requests" not in body:
            raise invalid_request("requests: Field required")
        unknown = sorted(set(body) - {"requests"})
        if unknown:
            raise invalid_request(f"{unknown[0]}: Extra inputs are not permitted")
        try:
            batch = message_batch_create(
                tenant=request_access(request).tenant,
                api_key=cast(ApiKey, request.auth),
                user=request_user(request),
                requests=body["requests"],
                version=str(request.headers[VERSION_HEADER]),
            )
        except MessageBatchRefused as exc:
            raise _refused(exc) from None
        except QuotaExceeded as exc:
            raise submission_refused(exc) from None
        return Response(message_batch_object(batch, request=request))


class MessageBatchView(MessageBatchesApiView):
    @extend_schema(operation_id="retrieveMessageBatch", tags=TAGS, responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(message_batch_object(self.batch(request, batch_id), request=request))

    @extend_schema(operation_id="deleteMessageBatch", tags=TAGS, responses=OpenApiTypes.OBJECT)
    def delete(self, request: Request, batch_id: str) -> Response:
        try:
            message_batch_delete(batch=self.batch(request, batch_id))
        except MessageBatchRefused as exc:
            raise _refused(exc) from None
        return Response({"id": batch_id, "type": "message_batch_deleted"})


class MessageBatchCancelView(MessageBatchesApiView):
    @extend_schema(operation_id="cancelMessageBatch", tags=TAGS, request=None, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request, batch_id: str) -> Response:
        try:
            batch = message_batch_cancel(batch=self.batch(request, batch_id), actor=request_user(request))
        except (CannotStop, MessageBatchRefused) as exc:
            raise invalid_request(str(exc)) from None
        return Response(message_batch_object(batch, request=request))


class MessageBatchResultsView(MessageBatchesApiView):
    renderer_classes = DOWNLOAD_RENDERERS

    @extend_schema(
        operation_id="messageBatchResults", tags=TAGS, responses={(200, "application/binary"): OpenApiTypes.BINARY}
    )
    def get(self, request: Request, batch_id: str) -> StreamingHttpResponse:
        batch = self.batch(request, batch_id)
        status = processing_status(batch)
        if status != "ended":
            raise invalid_request(f"{batch_id} is {status}; its results are ready once it has ended")
        try:
            lines = message_batch_results(batch)
        except TransientStorageError as exc:
            # Worth retrying, and the status says so (clients retry 5xx).
            raise ApiError(
                f"the results of {batch_id} cannot be read now: {exc}", status_code=503, code="api_error"
            ) from None
        except StorageError:
            raise ApiError(
                f"the results of {batch_id} are no longer stored", status_code=404, code="not_found"
            ) from None
        response = StreamingHttpResponse(lines, content_type="application/binary")
        response["Content-Disposition"] = f'attachment; filename="{batch_id}_results.jsonl"'
        return response
