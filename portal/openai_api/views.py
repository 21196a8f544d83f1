"""OpenAI's Batch API (`/v1/files`, `/v1/batches`), so that unchanged OpenAI client code runs here.

Same keys, same tenant scoping, same roles and quotas as `/api/v1/`; the views only translate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

from django.db.models import Q, QuerySet
from django.http import QueryDict, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from portal.api.access import request_access, request_user
from portal.api.downloads import DOWNLOAD_RENDERERS, stream_object
from portal.api.errors import ApiError, conflict, submission_refused, too_large
from portal.api.parsers import JSONParser
from portal.jobs.quota import QuotaExceeded
from portal.jobs.services.stop import CannotStop
from portal.jobs.services.uploads import UploadTooLarge
from portal.openai_api.models import Batch, File
from portal.openai_api.selectors import batch_object, file_object
from portal.openai_api.services.batches import BatchRefused, batch_cancel, batch_create
from portal.openai_api.services.files import FileRefused, file_delete, file_upload
from tasks.shared.storage import StorageError, TransientStorageError

TAGS = ["openai-batch"]
AFTER_PARAMETER = OpenApiParameter("after", str, description="The id of the last object of the previous page.")
BATCH_PAGE_PARAMETERS = [
    AFTER_PARAMETER,
    OpenApiParameter("limit", int, description="Objects per page, 1 to 100 (default 20)."),
]
FILE_PAGE_PARAMETERS = [
    AFTER_PARAMETER,
    OpenApiParameter("limit", int, description="Objects per page, 1 to 10,000 (default 10,000)."),
    OpenApiParameter("order", str, enum=["asc", "desc"], description="By `created_at` (default desc)."),
    OpenApiParameter("purpose", str, description="Only files of this purpose."),
]
# A multipart field of an object, as the openai client encodes one: `expires_after[seconds]`.
FORM_OBJECT_FIELD = re.compile(r"(?P<name>\w+)\[(?P<key>\w+)\]")


class ExpiresAfterSerializer(serializers.Serializer):
    anchor = serializers.CharField(max_length=20)
    seconds = serializers.IntegerField()


class FileUploadSerializer(serializers.Serializer):
    file = serializers.FileField()
    purpose = serializers.CharField(max_length=20)
    expires_after = ExpiresAfterSerializer(required=False)


class BatchCreateSerializer(serializers.Serializer):
    input_file_id = serializers.CharField(max_length=40)
    endpoint = serializers.CharField(max_length=50)
    completion_window = serializers.CharField(max_length=10)
    metadata = serializers.DictField(child=serializers.CharField(allow_blank=True), required=False, allow_null=True)
    output_expires_after = ExpiresAfterSerializer(required=False)


class BatchPageSerializer(serializers.Serializer):
    """OpenAI's paging of batches: newest first, up to 100 a page."""

    after = serializers.CharField(required=False, max_length=40)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=20)


class FilePageSerializer(BatchPageSerializer):
    """OpenAI's paging of files: up to 10,000 a page, either order, of one purpose."""

    limit = serializers.IntegerField(required=False, min_value=1, max_value=10_000, default=10_000)
    order = serializers.ChoiceField(choices=["asc", "desc"], required=False, default="desc")
    purpose = serializers.CharField(required=False, max_length=20)


def _not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(f"no {kind} with id {object_id!r}", status_code=404, code="not_found", param="id")


def _form_with_objects(data: QueryDict) -> dict[str, Any]:
    """A multipart form as a dict, its `name[key]` fields gathered into an object `name`."""
    plain: dict[str, Any] = {}
    objects: dict[str, dict[str, Any]] = {}
    for key in data:
        match = FORM_OBJECT_FIELD.fullmatch(key)
        if match is None:
            plain[key] = data[key]
        else:
            objects.setdefault(match["name"], {})[match["key"]] = data[key]
    return {**plain, **objects}


def _page_query(serializer: type[serializers.Serializer], request: Request) -> Mapping[str, Any]:
    """The list's parameters, checked: a bad one is a 400 naming it."""
    query = serializer(data=request.query_params)
    query.is_valid(raise_exception=True)
    return query.validated_data


def _page(queryset: QuerySet[Any], render: Any, query: Mapping[str, Any]) -> Response:
    """OpenAI's list shape: ordered by `created_at` (newest first unless `order=asc`), `after` the last
    id seen, `has_more` when there is more."""
    after, limit = query.get("after"), query["limit"]
    descending = query.get("order", "desc") == "desc"
    queryset = queryset.order_by(*(("-created_at", "-id") if descending else ("created_at", "id")))
    if after:
        anchor = queryset.filter(pk=after).values("created_at", "id").first()
        if anchor is None:
            raise ApiError(f"no object with id {after!r} to page after", status_code=400, code="invalid", param="after")
        beyond = "lt" if descending else "gt"
        queryset = queryset.filter(
            Q(**{f"created_at__{beyond}": anchor["created_at"]})
            | Q(created_at=anchor["created_at"], **{f"id__{beyond}": anchor["id"]})
        )
    rows = list(queryset[: limit + 1])
    data = [render(row) for row in rows[:limit]]
    return Response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(rows) > limit,
        }
    )


class FilesView(APIView):
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(operation_id="listFiles", tags=TAGS, parameters=FILE_PAGE_PARAMETERS, responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        query = _page_query(FilePageSerializer, request)
        files = File.objects.unexpired().filter(tenant=request_access(request).tenant)
        if query.get("purpose"):
            files = files.filter(purpose=query["purpose"])
        return _page(files, file_object, query)

    @extend_schema(
        operation_id="createFile",
        tags=TAGS,
        request={"multipart/form-data": FileUploadSerializer},
        responses={200: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request) -> Response:
        # The multipart and form parsers give a QueryDict.
        form = FileUploadSerializer(data=_form_with_objects(cast(QueryDict, request.data)))
        form.is_valid(raise_exception=True)
        upload = form.validated_data["file"]
        try:
            file = file_upload(
                tenant=request_access(request).tenant,
                filename=upload.name or "batch.jsonl",
                purpose=form.validated_data["purpose"],
                chunks=upload.chunks(),
                expires_after=form.validated_data.get("expires_after"),
            )
        except FileRefused as exc:
            raise ApiError(str(exc), status_code=400, code="invalid", param=exc.param) from None
        except UploadTooLarge as exc:
            raise too_large(str(exc)) from None
        except QuotaExceeded as exc:
            raise submission_refused(exc) from None
        return Response(file_object(file))


class FileView(APIView):
    def _file(self, request: Request, file_id: str) -> File:
        file = File.objects.unexpired().filter(tenant=request_access(request).tenant, pk=file_id).first()
        if file is None:
            raise _not_found("file", file_id)
        return file

    @extend_schema(operation_id="retrieveFile", tags=TAGS, responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, file_id: str) -> Response:
        return Response(file_object(self._file(request, file_id)))

    @extend_schema(operation_id="deleteFile", tags=TAGS, responses=OpenApiTypes.OBJECT)
    def delete(self, request: Request, file_id: str) -> Response:
        file = self._file(request, file_id)
        file_delete(file=file)
        return Response({"id": file_id, "object": "file", "deleted": True})


class FileContentView(FileView):
    renderer_classes = DOWNLOAD_RENDERERS
    http_method_names = ["get", "head", "options"]  # not the deletion it inherits

    @extend_schema(
        operation_id="downloadFile", tags=TAGS, responses={(200, "application/octet-stream"): OpenApiTypes.BINARY}
    )
    def get(self, request: Request, file_id: str) -> StreamingHttpResponse:  # type: ignore[override]
        file = self._file(request, file_id)
        try:
            return stream_object(file.uri, filename=file.filename, content_type="application/octet-stream")
        except TransientStorageError as exc:
            # Worth retrying, and the status says so (clients retry 5xx).
            raise ApiError(
                f"the content of {file_id} cannot be read now: {exc}", status_code=503, code="storage_unavailable"
            ) from None
        except StorageError as exc:
            raise conflict(f"the content of {file_id} cannot be read: {exc}") from None


class BatchesView(APIView):
    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="listBatches", tags=TAGS, parameters=BATCH_PAGE_PARAMETERS, responses=OpenApiTypes.OBJECT
    )
    def get(self, request: Request) -> Response:
        batches = (
            Batch.objects.select_related("job__model")
            .prefetch_related("job__events")
            .filter(tenant=request_access(request).tenant)
        )
        query = _page_query(BatchPageSerializer, request)
        return _page(batches, lambda batch: batch_object(batch, request=request), query)

    @extend_schema(
        operation_id="createBatch", tags=TAGS, request=BatchCreateSerializer, responses={200: OpenApiTypes.OBJECT}
    )
    def post(self, request: Request) -> Response:
        form = BatchCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        data = form.validated_data
        try:
            batch = batch_create(
                tenant=request_access(request).tenant,
                user=request_user(request),
                input_file_id=data["input_file_id"],
                endpoint=data["endpoint"],
                completion_window=data["completion_window"],
                metadata=data.get("metadata"),
                output_expires_after=data.get("output_expires_after"),
            )
        except BatchRefused as exc:
            raise ApiError(str(exc), status_code=400, code="invalid", param=exc.param) from None
        except QuotaExceeded as exc:
            raise submission_refused(exc) from None
        return Response(batch_object(batch, request=request), status=status.HTTP_200_OK)


class BatchView(APIView):
    def _batch(self, request: Request, batch_id: str) -> Batch:
        batch = (
            Batch.objects.select_related("job__model")
            .prefetch_related("job__events")
            .filter(tenant=request_access(request).tenant, pk=batch_id)
            .first()
        )
        if batch is None:
            raise _not_found("batch", batch_id)
        return batch

    @extend_schema(operation_id="retrieveBatch", tags=TAGS, responses=OpenApiTypes.OBJECT)
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(batch_object(self._batch(request, batch_id), request=request))


class BatchCancelView(BatchView):
    http_method_names = ["post", "options"]  # not the retrieval it inherits

    @extend_schema(operation_id="cancelBatch", tags=TAGS, request=None, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request, batch_id: str) -> Response:
        try:
            batch = batch_cancel(batch=self._batch(request, batch_id), actor=request_user(request))
        except CannotStop as exc:
            raise conflict(str(exc)) from None
        return Response(batch_object(batch, request=request))
