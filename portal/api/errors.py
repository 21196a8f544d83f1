"""One error shape for every API response, the same as OpenAI's so its clients read ours:

    {"error": {"type": ..., "code": ..., "message": ..., "param": <field or null>, ...details}}

Details: `fields` (field → messages) for invalid requests, `lines` for bad input lines, `quota` for
refusals by a quota.

OpenAI's clients retry 408, 409, 429 and 5xx unless the header `x-should-retry` says otherwise. A
request that can never succeed is answered with a status they do not retry, or with `x-should-retry:
false`: every 409 here is a state conflict (a batch that has ended cannot be cancelled), not the lock
timeout the clients retry it for, and a 429 for a quota that retrying cannot free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db.models import ProtectedError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.api.error_types import API_PREFIXES, ERROR_TYPES
from portal.catalog.protection import protected_message
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import InputTooLarge, SubmissionError


class ApiError(exceptions.APIException):
    """An API error with a code, the field it concerns, and details added to the error object."""

    retry: bool | None = None
    """Sent, when set, as `x-should-retry`, which OpenAI's clients obey over the status."""

    def __init__(self, message: str, *, status_code: int, code: str, param: str | None = None, **details: Any) -> None:
        super().__init__(message, code)
        self.status_code = status_code
        self.param = param
        self.details = details


def conflict(message: str) -> ApiError:
    """A request the object's state refuses; retrying at once gets the same answer."""
    error = ApiError(message, status_code=status.HTTP_409_CONFLICT, code="conflict")
    error.retry = False
    return error


def too_large(message: str) -> ApiError:
    return ApiError(message, status_code=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE, code="payload_too_large")


def submission_refused(exc: SubmissionError, *, field: str | None = None) -> ApiError:
    """A refused submission as an API error: 429 for a quota, 400 naming the field otherwise."""
    if isinstance(exc, QuotaExceeded):
        quota = {"name": exc.quota, "limit": exc.limit, "current": exc.current, "requested": exc.requested}
        error = ApiError(exc.message, status_code=429, code="quota_exceeded", param=exc.quota, quota=quota)
        error.retry = exc.may_pass_later
        return error
    param = field or exc.field
    details: dict[str, Any] = {"fields": {param: [exc.message]}}
    if isinstance(exc, InputTooLarge):
        # 400, not 413: the request may be small (a file:// or s3:// input); what is refused is what
        # its input expands to, whichever way it came, and retrying cannot change that.
        details["limit"] = {"name": exc.setting, "value": exc.limit}
        return ApiError(exc.message, status_code=400, code="input_too_large", param=param, **details)
    if exc.problems:
        details["lines"] = [{"line": problem.line, "message": problem.message} for problem in exc.problems]
    return ApiError(exc.message, status_code=400, code="invalid_input", param=param, **details)


def _flatten(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """Field errors as `{"a.b": [messages]}`, however deeply the serializer nested them."""
    if isinstance(detail, Mapping):
        flat: dict[str, list[str]] = {}
        for key, value in detail.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(detail, Sequence) and not isinstance(detail, str):
        if all(not isinstance(item, Mapping | list) for item in detail):
            return {prefix or "non_field_errors": [str(item) for item in detail]}
        flat = {}
        for index, item in enumerate(detail):
            flat.update(_flatten(item, f"{prefix}.{index}" if prefix else str(index)))
        return flat
    return {prefix or "non_field_errors": [str(detail)]}


def _validation_body(exc: exceptions.ValidationError) -> dict[str, Any]:
    fields = _flatten(exc.detail)
    first_field, messages = next(iter(fields.items()))
    param = None if first_field == "non_field_errors" else first_field
    message = messages[0] if param is None else f"{first_field}: {messages[0]}"
    return {"code": "invalid", "message": message, "param": param, "fields": fields}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("no such object (or not one of your tenant's)")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)
    elif isinstance(exc, ProtectedError):
        exc = conflict(protected_message(exc))
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        body = _validation_body(exc)
    elif isinstance(exc, ApiError):
        body = {"code": getattr(exc.detail, "code", exc.default_code), "message": str(exc.detail)}
        body.update(param=exc.param, **exc.details)
    elif isinstance(exc, exceptions.APIException):
        detail = exc.detail
        code = detail.code if isinstance(detail, exceptions.ErrorDetail) else exc.default_code
        body = {"code": code, "message": str(detail), "param": None}
    else:
        body = {"code": "error", "message": str(response.data), "param": None}
    response.data = {"error": {"type": ERROR_TYPES.get(response.status_code, "server_error"), **body}}
    if isinstance(exc, ApiError) and exc.retry is not None:
        response["x-should-retry"] = "true" if exc.retry else "false"
    # Errors are JSON even where the negotiated renderer is a download's.
    response.content_type = "application/json"
    return response


def _json_error(status_code: int, code: str, message: str) -> JsonResponse:
    error = {"type": ERROR_TYPES.get(status_code, "server_error"), "code": code, "message": message, "param": None}
    return JsonResponse({"error": error}, status=status_code)


def _is_api(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIXES)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """Django's 404 handler: the API's error shape under the API's prefixes, the usual page elsewhere."""
    if _is_api(request):
        return _json_error(404, "not_found", f"no such endpoint: {request.method} {request.path}")
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if _is_api(request):
        return _json_error(500, "server_error", "the server failed; the error was logged")
    return defaults.server_error(request)
