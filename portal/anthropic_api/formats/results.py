"""A Batchery chat job's output line as a line of Anthropic's message batch results.

Each output line, ``{"custom_id", "response"}`` or ``{"custom_id", "error": {"code", "message"}}``, becomes
``{"custom_id", "result"}``: ``succeeded`` with a whole Anthropic ``Message``, ``canceled`` or ``expired``
for a record the job's cancel or deadline stopped before it ran, or ``errored`` with Anthropic's error
object, ``invalid_request_error`` where the request was at fault and ``api_error`` otherwise.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import orjson

from portal.openai_api.formats.output_file import CLIENT_ERROR_CODES

STOPPED_RESULTS: Mapping[str, str] = {"cancelled": "canceled", "expired": "expired"}
"""Batchery's error codes for records that never ran, to Anthropic's result types."""

STOP_REASONS: Mapping[str, str] = {"length": "max_tokens", "tool_calls": "tool_use"}
"""The engine's ``finish_reason`` to Anthropic's ``stop_reason``; ``stop`` is ``end_turn`` or ``stop_sequence``."""


def result_line(line: Mapping[str, Any], *, batch_id: str, model: str) -> bytes:
    """The results line, newline-terminated, of one output line of the job; ``model`` is the name the
    requests gave. Ids are derived from ``batch_id`` and the custom_id: the same on every read."""
    custom_id = str(line["custom_id"])
    error = line.get("error")
    result: dict[str, Any]
    if error is None:
        # A record that ran with a LoRA adapter names it (`name@version`); the others ran the batch's model.
        ran = str(line["response"].get("model") or model)
        result = _succeeded(line["response"], _derived_id(batch_id, custom_id), ran)
    elif error.get("code") in STOPPED_RESULTS:
        result = {"type": STOPPED_RESULTS[error["code"]]}
    else:
        kind = "invalid_request_error" if error.get("code") in CLIENT_ERROR_CODES else "api_error"
        result = errored(kind, str(error.get("message", "")))
    return orjson.dumps({"custom_id": custom_id, "result": result}, option=orjson.OPT_APPEND_NEWLINE)


def errored(kind: str, message: str) -> dict[str, Any]:
    """An ``errored`` result: Anthropic's error response of type ``kind``."""
    return {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": message}}}


def _derived_id(batch_id: str, custom_id: str) -> str:
    return hashlib.sha256(orjson.dumps([batch_id, custom_id])).hexdigest()[:24]


def _succeeded(response: Mapping[str, Any], ident: str, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    calls = response.get("tool_calls") or []
    # A reply of tool calls carries text only where the model wrote some beside them.
    if response.get("text") or not calls:
        content.append({"type": "text", "text": response.get("text", "")})
    for number, call in enumerate(calls):
        arguments = json.loads(call["arguments"])
        if not isinstance(arguments, dict):
            return errored("api_error", f"the model called {call['name']!r} with arguments that are not a JSON object")
        content.append(
            {"type": "tool_use", "id": f"toolu_{ident}{number:02d}", "name": call["name"], "input": arguments}
        )
    finish_reason = str(response.get("finish_reason"))
    stop_sequence = response.get("stop_sequence") if finish_reason == "stop" else None
    stop_reason = "stop_sequence" if stop_sequence is not None else STOP_REASONS.get(finish_reason, "end_turn")
    usage = response["usage"]
    # Anthropic counts the prompt tokens read from a cache apart from the input tokens computed.
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "type": "succeeded",
        "message": {
            "id": f"msg_{ident}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": int(usage["prompt_tokens"]) - cached,
                "output_tokens": int(usage["completion_tokens"]),
                # A shared prefix is computed by the first record that needs it, not written by a request: no
                # creation counted apart, a zero rather than an absent field.
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "service_tier": "batch",
            },
        },
    }
