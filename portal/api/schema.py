"""The OpenAPI schema's error responses: every operation documents the errors the API can give, in the
one shape of `portal.api.errors`, and Anthropic's for the Message Batches API."""

from __future__ import annotations

from typing import Any

from portal.api.error_types import ANTHROPIC_PREFIX

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "code", "message", "param"],
            "properties": {
                "type": {"type": "string", "example": "invalid_request_error"},
                "code": {"type": "string", "example": "invalid"},
                "message": {"type": "string"},
                "param": {"type": "string", "nullable": True, "description": "The field at fault, if one is."},
                "fields": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "string"}},
                    "description": "Messages per field of an invalid request.",
                },
                "lines": {
                    "type": "array",
                    "description": "Bad lines of an input file (1-based).",
                    "items": {
                        "type": "object",
                        "properties": {"line": {"type": "integer"}, "message": {"type": "string"}},
                    },
                },
                "quota": {
                    "type": "object",
                    "description": "The quota that refused the request, its limit and current use.",
                    "properties": {"name": {"type": "string"}, "limit": {}, "current": {}, "requested": {}},
                },
            },
        }
    },
}

ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "example": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string", "example": "invalid_request_error"},
                "message": {"type": "string"},
            },
        },
    },
}
"""Anthropic's error shape, which the Message Batches API (`portal.anthropic_api`) answers in."""

ERRORS = {
    "400": "Invalid request: `error.param` and `error.fields` name the problem.",
    "401": "No valid API key (or session).",
    "403": "Your role in the tenant does not allow this.",
    "404": "No such object in your tenant.",
    "405": "Method not allowed.",
    "406": "The Accept header asks for a type this operation cannot give.",
    "409": "The object is not in a state for this action.",
    "411": "A request body came without its Content-Length (chunked).",
    "413": "The request body or the upload is over its size limit.",
    "415": "Unsupported request content type.",
    "429": "A quota refuses the request (`error.quota` names it, its limit and current use), or too many failed "
    "attempts (`Retry-After` says when to try again).",
}
WRITE_ONLY_ERRORS = {"409", "411", "413", "415", "429"}


def add_error_responses(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the Error component, referenced by every operation."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = ERROR_SCHEMA
    schemas["AnthropicError"] = ANTHROPIC_ERROR_SCHEMA
    openai = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    # The body-size checks answer before any view, in the shape of the rest of the API.
    anthropic = {
        "application/json": {
            "schema": {
                "anyOf": [{"$ref": "#/components/schemas/AnthropicError"}, {"$ref": "#/components/schemas/Error"}]
            }
        }
    }
    for path, path_item in result.get("paths", {}).items():
        reference = anthropic if path.startswith(ANTHROPIC_PREFIX) else openai
        for method, operation in path_item.items():
            responses = operation.setdefault("responses", {})
            for code, description in ERRORS.items():
                if code in WRITE_ONLY_ERRORS and method == "get":
                    continue
                existing = responses.setdefault(code, {"description": description})
                existing.setdefault("content", reference)
    return result
