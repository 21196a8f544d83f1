"""Anthropic's error shape for every answer of `/v1/messages/batches`:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "requests.3.params.max_tokens: ..."}}

with Anthropic's type for each status. Anthropic's clients retry 408, 409, 429 and 5xx unless the header
`x-should-retry` says otherwise; a quota that retrying cannot free says so.
"""

from __future__ import annotations

from typing import Any

from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.api.error_types import ANTHROPIC_ERROR_TYPES
from portal.api.errors import ApiError


def invalid_request(message: str) -> ApiError:
    return ApiError(message, status_code=400, code="invalid_request_error")


def not_found(batch_id: str) -> ApiError:
    return ApiError(f"no message batch with id {batch_id!r}", status_code=404, code="not_found_error")


def _first_complaint(detail: Any, field: str = "") -> str:
    """A validation error's first complaint, named by its field: `limit: Ensure this value is ...`."""
    if isinstance(detail, dict) and detail:
        name, inner = next(iter(detail.items()))
        return _first_complaint(inner, f"{field}.{name}" if field else str(name))
    if isinstance(detail, list) and detail:
        return _first_complaint(detail[0], field)
    return f"{field}: {detail}" if field else str(detail)


def _message(exc: Exception, data: Any) -> str:
    if isinstance(exc, exceptions.ValidationError):
        return _first_complaint(exc.detail)
    if isinstance(exc, exceptions.APIException):
        return str(exc.detail)
    return str(data)


def anthropic_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler (statuses, `WWW-Authenticate`, `Retry-After`), its body in Anthropic's shape."""
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    error = {
        "type": ANTHROPIC_ERROR_TYPES.get(response.status_code, "api_error"),
        "message": _message(exc, response.data),
    }
    response.data = {"type": "error", "error": error}
    if isinstance(exc, ApiError) and exc.retry is not None:
        response["x-should-retry"] = "true" if exc.retry else "false"
    response.content_type = "application/json"
    return response
