"""Where the API's error shape applies and the `type` each status gets in it, and the same of Anthropic's shape
(the Message Batches API, `portal.anthropic_api`); imports nothing of DRF, so that a middleware that runs
before DRF is loaded can answer in the shape of the API a request was for."""

from __future__ import annotations

API_PREFIXES = ("/api/", "/v1/")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}

ANTHROPIC_PREFIX = "/v1/messages/"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    411: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
}
"""Anthropic's error type of each status; any other is an `api_error`."""
