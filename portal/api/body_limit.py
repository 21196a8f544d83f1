"""Every request body has a size limit, refused from its headers before a byte of it is read.

A multipart body (an upload: the REST API's and /v1/files' `file`, the portal's submit form) may be
as large as an upload (`BATCHERY_MAX_UPLOAD_BYTES`) plus room for its envelope; any other body as
large as `BATCHERY_MAX_REQUEST_BYTES`. Over its limit a request is answered 413 from its
`Content-Length`, in the API's error shape under the API's prefixes (Anthropic's under the Message
Batches API's). A body without a length (chunked)
is answered 411: Django reads a request's body only up to its `Content-Length`, so such a body would
otherwise reach a view as empty.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from portal.api.error_types import ANTHROPIC_ERROR_TYPES, ANTHROPIC_PREFIX, API_PREFIXES, ERROR_TYPES

ENVELOPE_BYTES = 64 * 1024
"""Room for the multipart envelope and the other form fields around an uploaded file."""


def body_limit(request: HttpRequest) -> tuple[int, str]:
    """The most bytes `request`'s body may hold, and the setting that says so."""
    if request.content_type == "multipart/form-data":
        return settings.BATCHERY_MAX_UPLOAD_BYTES + ENVELOPE_BYTES, "BATCHERY_MAX_UPLOAD_BYTES"
    return settings.BATCHERY_MAX_REQUEST_BYTES, "BATCHERY_MAX_REQUEST_BYTES"


def _refusal(request: HttpRequest, status: int, code: str, message: str) -> HttpResponse:
    if request.path.startswith(ANTHROPIC_PREFIX):
        anthropic = {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}
        response: HttpResponse = JsonResponse({"type": "error", "error": anthropic}, status=status)
        response["x-should-retry"] = "false"
    elif request.path.startswith(API_PREFIXES):
        error = {"type": ERROR_TYPES.get(status, "invalid_request_error"), "code": code, "message": message}
        response = JsonResponse({"error": {**error, "param": None}}, status=status)
        response["x-should-retry"] = "false"
    else:
        response = HttpResponse(message + "\n", status=status, content_type="text/plain; charset=utf-8")
    return response


class RequestBodyLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        declared = request.META.get("CONTENT_LENGTH") or ""
        if not declared:
            if "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
                return _refusal(
                    request, 411, "length_required", "a request body must come with its Content-Length (not chunked)"
                )
            return self.get_response(request)
        if not declared.isdigit():
            return _refusal(request, 400, "invalid_content_length", f"Content-Length {declared!r} is not a number")
        limit, setting = body_limit(request)
        if int(declared) > limit:
            return _refusal(
                request,
                413,
                "payload_too_large",
                f"the request body is {declared} bytes, over the limit of {limit} bytes ({setting})",
            )
        return self.get_response(request)
