"""A Batchery job's output to OpenAI's batch output and error files, with the response bodies of OpenAI's
endpoints (``CreateEmbeddingResponse``, ``ChatCompletion``, ``Completion``, ``Response``, moderations)."""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson

from portal.openai_api.formats.endpoints import (
    EMBEDDING_ENCODINGS,
    MODERATION_CATEGORIES,
    MODERATION_THRESHOLD,
    MODERATIONS,
    RESPONSES,
    endpoint_for,
)


@dataclass(frozen=True)
class OutputCounts:
    """Requests written to the output file (``completed``) and to the error file (``failed``)."""

    completed: int
    failed: int


STOPPED_BATCH_ERRORS: Mapping[str, tuple[str, str]] = {
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "budget_exceeded": (
        "budget_exceeded",
        "This request was not executed because the tenant's monthly budget was reached; retry the batch's job "
        "once the budget allows.",
    ),
}
"""Batchery's codes for records that never ran, to OpenAI's ``(code, message)``: these get no response."""

CLIENT_ERROR_CODES = frozenset({"engine_error", "input_too_long", "invalid_model", "invalid_request"})
"""Record failures that are the request's fault, answered with status 400: the engine raised on the record
when it ran alone (a bad input or param), the input is longer than the model takes, the model cannot
serve the endpoint, or the request was refused at submission and did not run. Any other failure
(``out_of_memory``, ``poison_record``, ``shard_failed``...) is the server's: status 500."""

UNLIKELY_LOGPROB = -9999.0
"""OpenAI's logprob for a token outside the likeliest ones; stands in where the engine has none."""


def convert_outputs(
    source: Iterable[bytes],
    output: BinaryIO,
    errors: BinaryIO,
    *,
    endpoint: str,
    model: str,
    batch_id: str,
    created: int,
    encoding_format: str = "float",
    system_fingerprint: str | None = None,
) -> OutputCounts:
    """Write a Batchery job's output lines as OpenAI's batch output (successes) and error (failures) files.

    ``model`` is the name the requests gave, ``created`` the Unix time given to each completion, and
    ``encoding_format`` the embeddings' (the job's param: ``float`` or ``base64``), ``system_fingerprint``
    the completions' (`system_fingerprint`: what served them). Every id is derived
    from ``batch_id`` and the custom_id, so converting the same output twice gives the same files.
    Raises `UnsupportedEndpoint`, or ValueError for another ``encoding_format``, before reading anything.
    """
    task = endpoint_for(endpoint).task
    if encoding_format not in EMBEDDING_ENCODINGS:
        raise ValueError(f"encoding_format must be 'float' or 'base64', not {encoding_format!r}")
    completed = failed = 0
    for raw in source:
        if not raw.strip():
            continue
        record = orjson.loads(raw)
        custom_id = record["custom_id"]
        line: dict[str, Any] = {
            "id": "batch_req_" + _derived_id("batch_req", batch_id, custom_id),
            "custom_id": custom_id,
        }
        request_id = _derived_id("request", batch_id, custom_id)
        if record.get("error") is None and endpoint == MODERATIONS and not _scores_moderation(record["response"]):
            labels = ", ".join(sorted(record["response"].get("scores", {})))
            message = (
                f"model {model!r} scores {labels}, none of OpenAI's moderation categories; "
                "its catalog entry's label_map must name them"
            )
            record = {**record, "error": {"code": "invalid_model", "message": message}}
        if record.get("error") is None:
            ident = _derived_id(task, batch_id, custom_id)
            # A record that ran with a LoRA adapter names it (`name@version`); the others ran the batch's model.
            ran = str(record["response"].get("model") or model)
            if endpoint == RESPONSES:
                body = _responses_body(record["response"], ran, created, ident)
            elif endpoint == MODERATIONS:
                body = _moderation_body(record["response"], ran, ident)
            else:
                body = _response_body(task, record["response"], ran, created, ident)
            if task in ("generate", "chat") and endpoint != RESPONSES:
                body["system_fingerprint"] = system_fingerprint
            if task == "embed" and encoding_format == "base64":
                for item in body["data"]:
                    item["embedding"] = _base64_floats(item["embedding"])
            line.update(response={"status_code": 200, "request_id": request_id, "body": body}, error=None)
            output.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
            completed += 1
            continue
        line.update(_failure(record["error"], request_id))
        errors.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        failed += 1
    return OutputCounts(completed=completed, failed=failed)


def system_fingerprint(engine: str, name: str, version: str) -> str:
    """What served a batch's completions, as OpenAI's ``system_fingerprint`` tells a client that the backend
    changed: the engine and the catalog model's version."""
    return f"batchery-{engine}-{name}@{version}"


def _derived_id(kind: str, batch_id: str, custom_id: str) -> str:
    """32 hex digits from the batch and the request: stable across conversions, distinct per kind of id."""
    return hashlib.sha256(orjson.dumps([kind, batch_id, custom_id])).hexdigest()[:32]


def _failure(error: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    """The ``response`` and ``error`` of a failed request's line."""
    code, message = str(error.get("code")), str(error.get("message", ""))
    if code in STOPPED_BATCH_ERRORS:
        openai_code, openai_message = STOPPED_BATCH_ERRORS[code]
        return {"response": None, "error": {"code": openai_code, "message": openai_message}}
    client_fault = code in CLIENT_ERROR_CODES
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error" if client_fault else "server_error",
            "param": None,
            "code": code,
        }
    }
    response = {"status_code": 400 if client_fault else 500, "request_id": request_id, "body": body}
    return {"response": response, "error": None}


def _response_body(task: str, response: Mapping[str, Any], model: str, created: int, ident: str) -> dict[str, Any]:
    """The OpenAI response body for one engine response of the task."""
    usage = response["usage"]
    prompt_tokens = int(usage["prompt_tokens"])
    if task == "embed":
        # A request of a list of texts got one embedding a text, in order ("embeddings"); one of a text, one.
        embeddings = response["embeddings"] if "embeddings" in response else [response["embedding"]]
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": index, "embedding": embedding}
                for index, embedding in enumerate(embeddings)
            ],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    completion_tokens = int(usage["completion_tokens"])
    # The engine lists every sample in "choices" only when there are several; one sample is the response itself.
    samples = response.get("choices") or [{**response, "index": 0}]
    if task == "chat":
        choices = [_chat_choice(sample, ident) for sample in samples]
        prefix, kind = "chatcmpl-", "chat.completion"
    else:
        choices = [_text_choice(sample) for sample in samples]
        prefix, kind = "cmpl-", "text_completion"
    return {
        "id": prefix + ident,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # The prompt tokens a shared prefix's cache served, as the engine counted them; no audio, reasoning
            # or predicted outputs here: OpenAI's zeros, not absent fields, so that clients summing them need
            # no special case.
            "prompt_tokens_details": {"cached_tokens": _cached_tokens(usage), "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
    }


def _cached_tokens(usage: Mapping[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _scores_moderation(response: Mapping[str, Any]) -> bool:
    return bool(set(response.get("scores", {})) & set(MODERATION_CATEGORIES))


def _moderation_body(response: Mapping[str, Any], model: str, ident: str) -> dict[str, Any]:
    """OpenAI's moderation result for one classified text. A category the model does not score reads false,
    with score 0 and no input type it was applied to, so a client can tell it from one judged clean."""
    scores = response["scores"]
    return {
        "id": "modr-" + ident,
        "model": model,
        "results": [
            {
                "flagged": any(scores.get(name, 0.0) >= MODERATION_THRESHOLD for name in MODERATION_CATEGORIES),
                "categories": {name: scores.get(name, 0.0) >= MODERATION_THRESHOLD for name in MODERATION_CATEGORIES},
                "category_scores": {name: float(scores.get(name, 0.0)) for name in MODERATION_CATEGORIES},
                "category_applied_input_types": {
                    name: ["text"] if name in scores else [] for name in MODERATION_CATEGORIES
                },
            }
        ],
    }


def _responses_body(response: Mapping[str, Any], model: str, created: int, ident: str) -> dict[str, Any]:
    """A Responses API ``Response`` for one generated reply; one cut at ``max_output_tokens`` is incomplete."""
    input_tokens, output_tokens = int(response["usage"]["prompt_tokens"]), int(response["usage"]["completion_tokens"])
    complete = response["finish_reason"] != "length"
    status = "completed" if complete else "incomplete"
    return {
        "id": "resp_" + ident,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None if complete else {"reason": "max_output_tokens"},
        "model": model,
        "output": [
            {
                "type": "message",
                "id": "msg_" + ident,
                "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": response["text"], "annotations": []}],
            }
        ],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": _cached_tokens(response["usage"]), "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def _chat_choice(sample: Mapping[str, Any], ident: str) -> dict[str, Any]:
    logprobs = sample.get("logprobs")
    message: dict[str, Any] = {"role": "assistant", "content": sample["text"], "refusal": None}
    if sample.get("tool_calls"):
        # As OpenAI answers a reply of tool calls: content only where text came with them (tool_choice auto),
        # each call with an id the next turn refers to.
        message["content"] = sample["text"] or None
        message["tool_calls"] = [
            {
                "id": "call_" + hashlib.sha256(f"{ident}:{sample['index']}:{number}".encode()).hexdigest()[:24],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for number, call in enumerate(sample["tool_calls"])
        ]
    return {
        "index": sample["index"],
        "message": message,
        "finish_reason": sample["finish_reason"],
        "logprobs": None if logprobs is None else {"content": _chat_logprobs(logprobs["content"]), "refusal": None},
    }


def _chat_logprobs(content: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # No "bytes": the engine gives decoded text, and a token cut inside a character has no faithful bytes.
    return [
        {
            "token": entry["token"],
            "logprob": _logprob(entry["logprob"]),
            "bytes": None,
            "top_logprobs": [
                {"token": top["token"], "logprob": _logprob(top["logprob"]), "bytes": None}
                for top in entry["top_logprobs"]
            ],
        }
        for entry in content
    ]


def _text_choice(sample: Mapping[str, Any]) -> dict[str, Any]:
    logprobs = sample.get("logprobs")
    return {
        "text": sample["text"],
        "index": sample["index"],
        "finish_reason": sample["finish_reason"],
        "logprobs": None if logprobs is None else _text_logprobs(logprobs["content"]),
    }


def _text_logprobs(content: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The engine's per-token logprobs (chat's shape) in the completions endpoint's column shape.

    ``text_offset`` counts characters from the start of the completion, as vLLM's OpenAI server does.
    """
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []
    offset = 0
    for entry in content:
        tokens.append(entry["token"])
        token_logprobs.append(_logprob(entry["logprob"]))
        top_logprobs.append({top["token"]: _logprob(top["logprob"]) for top in entry["top_logprobs"]})
        text_offset.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def _logprob(value: float | None) -> float:
    return UNLIKELY_LOGPROB if value is None else float(value)


def _base64_floats(values: list[float]) -> str:
    """An embedding as OpenAI's ``base64`` encoding gives it: little-endian float32s."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
