"""Every field of OpenAI's request bodies is either honoured by the model's engine or refused naming it.

The fields come from the official client's own request types, so a field OpenAI adds shows up here as one
that must be refused (the walk gives it a value no engine reads) until an engine honours it. Nothing a line
asks for is silently dropped, but the caller's own identifiers, which change no answer.
"""

from __future__ import annotations

import io
from typing import Any

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.embedding_create_params as embedding_params
import openai.types.responses.response_create_params as responses_params
import orjson
import pytest

from gpuworkers.engines.request_params import check_request_params
from gpuworkers.engines.sampling import ParamError
from portal.openai_api.formats.input_file import CALLER_FIELDS, convert_requests

EMBEDDINGS, COMPLETIONS, CHAT = "/v1/embeddings", "/v1/completions", "/v1/chat/completions"
ENDPOINTS = {
    EMBEDDINGS: ("embed", "input", "a sentence", embedding_params.EmbeddingCreateParams),
    COMPLETIONS: ("generate", "prompt", "Once upon", completion_params.CompletionCreateParamsNonStreaming),
    CHAT: ("chat", "messages", [{"role": "user", "content": "Hi"}], chat_params.CompletionCreateParamsNonStreaming),
}
ENGINES = {
    EMBEDDINGS: ("sentence_transformers", "vllm"),
    COMPLETIONS: ("vllm", "transformers"),
    CHAT: ("vllm", "transformers"),
}

# A valid value for each field some engine honours; any other field gets a value no engine reads.
HONOURED_VALUES: dict[str, Any] = {
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "temperature": 0.5,
    "top_p": 0.9,
    "n": 1,
    "seed": 3,
    "stop": ["\n"],
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {"50": 1},
    "top_logprobs": 2,
    "response_format": {"type": "json_object"},
    "dimensions": 8,
    "encoding_format": "float",
    "tools": [{"type": "function", "function": {"name": "get_time"}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
}
LOGPROBS = {COMPLETIONS: 2, CHAT: True}
# Fields OpenAI takes only beside another.
COMPANIONS: dict[str, dict[str, Any]] = {
    "top_logprobs": {"logprobs": True},
    "tools": {"tool_choice": "required"},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "get_time"}}]},
}

# What each engine honours of each endpoint's fields, the model and the input aside.
EXPECTED_HONOURED = {
    (EMBEDDINGS, "sentence_transformers"): {"dimensions", "encoding_format"},
    (EMBEDDINGS, "vllm"): {"dimensions", "encoding_format"},
    (COMPLETIONS, "vllm"): {
        "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
        "temperature", "top_p",
    },
    (COMPLETIONS, "transformers"): {"max_tokens", "seed", "stop", "temperature", "top_p", "n"},
    (CHAT, "vllm"): {
        "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "n",
        "presence_penalty", "response_format", "seed", "stop", "temperature", "top_logprobs", "top_p",
        "tools", "tool_choice", "parallel_tool_calls",
    },
    (CHAT, "transformers"): {"max_completion_tokens", "max_tokens", "n", "seed", "stop", "temperature", "top_p"},
}  # fmt: skip


def _fields(params_type: Any) -> set[str]:
    return set(params_type.__required_keys__ | params_type.__optional_keys__)


def _judge(engine: str, task: str) -> Any:
    def params_problem(model: str, params: Any) -> tuple[str, str] | None:
        try:
            check_request_params(engine, task, params)
        except ParamError as exc:
            return exc.field, str(exc)
        return None

    return params_problem


def _value(url: str, field: str) -> Any:
    if field == "logprobs":
        return LOGPROBS[url]
    if field == "stream":
        return False
    return HONOURED_VALUES.get(field, {"a value": "no engine reads"})


@pytest.mark.parametrize(("url", "engine"), [(url, engine) for url in ENDPOINTS for engine in ENGINES[url]])
def test_each_request_field_is_honoured_by_the_engine_or_refused_naming_it(url: str, engine: str) -> None:
    task, input_field, input_value, params_type = ENDPOINTS[url]
    honoured, refused, dropped = set(), set(), set()
    for field in sorted(_fields(params_type) - {"model", input_field}):
        companions = COMPANIONS.get(field, {})
        body = {"model": "m", input_field: input_value, **companions, field: _value(url, field)}
        line = orjson.dumps({"custom_id": "r", "method": "POST", "url": url, "body": body}) + b"\n"
        result = convert_requests(
            [line],
            io.BytesIO(),
            endpoint=url,
            max_line_bytes=1 << 20,
            params_problem=_judge(engine, task),
            # The model is taken to be Matryoshka-trained: that judge has its own tests.
            dimensions_problem=lambda model, dimensions: None,
        )
        if result.ok:
            if field in result.params:
                honoured.add(field)
            else:
                dropped.add(field)
            continue
        [problem] = result.problems
        assert problem.line == 1 and problem.param is not None, (field, problem)
        named = problem.param.removeprefix("body.").split(".")[0]
        assert named == field or named in companions, (field, problem)
        refused.add(field)

    assert honoured == EXPECTED_HONOURED[(url, engine)]
    # Dropped, changing no answer: the caller's identifiers, and stream false (a batch never streams).
    assert dropped == (_fields(params_type) & CALLER_FIELDS) | ({"stream"} & _fields(params_type))
    assert refused == _fields(params_type) - {"model", input_field} - honoured - dropped


RESPONSES_VALUES: dict[str, Any] = {
    "instructions": "Be brief.",
    "max_output_tokens": 4,
    "temperature": 0.5,
    "top_p": 0.9,
    "text": {"format": {"type": "json_object"}},
    "truncation": "disabled",
    "stream": False,
}


@pytest.mark.parametrize(
    ("engine", "accepted"),
    [
        ("vllm", {"instructions", "max_output_tokens", "temperature", "top_p", "text", "truncation"}),
        ("transformers", {"instructions", "max_output_tokens", "temperature", "top_p", "truncation"}),
    ],
)
def test_each_responses_field_is_honoured_or_refused_naming_it(engine: str, accepted: set[str]) -> None:
    fields = _fields(responses_params.ResponseCreateParamsNonStreaming) - {"model", "input"}
    taken, refused = set(), set()
    for field in sorted(fields):
        body = {"model": "m", "input": "Hi", field: RESPONSES_VALUES.get(field, {"a value": "no engine reads"})}
        line = orjson.dumps({"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}) + b"\n"
        result = convert_requests(
            [line],
            io.BytesIO(),
            endpoint="/v1/responses",
            max_line_bytes=1 << 20,
            params_problem=_judge(engine, "chat"),
        )
        if result.ok:
            taken.add(field)
            continue
        [problem] = result.problems
        assert problem.param is not None and problem.param.removeprefix("body.").split(".")[0] == field, problem
        refused.add(field)

    callers = fields & CALLER_FIELDS
    assert taken == accepted | callers | {"stream"}
    assert refused == fields - taken
