"""A message batch request's Messages API params as a chat record and the chat engine's params; what malforms the
request itself (and so the batch) apart from what is wrong in its params (which errors that request alone)."""

from __future__ import annotations

from typing import Any

import pytest

from portal.anthropic_api.formats.requests import (
    ChatRequest,
    RequestRefused,
    anthropic_field,
    convert_request,
    request_parts,
)

OLD, NEW = "2023-06-01", "2026-10-21"


def request(**params: Any) -> dict[str, Any]:
    body = {"model": "tiny-chat", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **params}
    return {"custom_id": "req-1", "params": {key: value for key, value in body.items() if value is not ...}}


def convert(value: Any, version: str = OLD) -> ChatRequest:
    custom_id, params = request_parts(value)
    return convert_request(custom_id, params, version=version)


def refusal(value: Any, version: str = OLD) -> RequestRefused:
    with pytest.raises(RequestRefused) as refused:
        convert(value, version)
    return refused.value


def test_a_request_of_text_becomes_a_chat_record_with_the_system_prompt_first_and_engine_params() -> None:
    converted = convert(
        request(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}],
                },
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Bye?"},
            ],
            temperature=0.5,
            top_p=0.9,
            stop_sequences=["\n\n"],
            metadata={"user_id": "u-1"},
            stream=False,
        ),
    )

    assert converted.custom_id == "req-1" and converted.model == "tiny-chat"
    assert converted.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye?"},
    ]
    assert converted.params == {"max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "stop": ["\n\n"]}


def test_anthropic_tools_and_tool_choice_become_openai_function_tools() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    converted = convert(
        request(
            tools=[{"name": "weather", "description": "The weather.", "input_schema": schema}],
            tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        ),
    )

    assert converted.params["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": schema}}
    ]
    assert converted.params["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert converted.params["parallel_tool_calls"] is False
    for choice, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        params = convert(
            request(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": choice}), version=OLD
        ).params
        assert params["tool_choice"] == expected


@pytest.mark.parametrize(
    ("value", "field", "words"),
    [
        ("not an object", "", "must be an object"),
        ({"custom_id": "req 1", "params": {}}, "custom_id", "1 to 64 characters"),
        ({"custom_id": "x" * 65, "params": {}}, "custom_id", "1 to 64 characters"),
        ({"custom_id": "ok", "params": {}, "extra": 1}, "extra", "Extra inputs"),
        ({"custom_id": "ok"}, "params", "must be an object"),
        (request(model=...), "params.model", "is required"),
        (request(max_tokens=...), "params.max_tokens", "is required"),
        (request(messages=[]), "params.messages", "non-empty list"),
        (request(messages=[{"role": "system", "content": "x"}]), "params.messages.0.role", "'user' or 'assistant'"),
        (
            request(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]),
            "params.messages.0.content.0.source.type",
            "image sources of type 'url' are not served here: GPU hosts fetch nothing a request names",
        ),
        (
            request(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
            "params.messages.0.content.0.type",
            "'document' are not served here; 'text' blocks and inline 'image' blocks are",
        ),
        (
            request(system=[{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]),
            "params.system.0.type",
            "'image' are not served here; only 'text' blocks are",
        ),
        (request(system=5), "params.system", "string or a non-empty list"),
        (request(stream=True), "params.stream", "do not stream"),
        (request(thinking={"type": "enabled"}), "params.thinking", "not a Messages API param served here"),
        (request(temperature=1.5), "params.temperature", "from 0 to 1"),
        (request(stop_sequences="\n"), "params.stop_sequences", "list of non-empty strings"),
        (request(tools=[{"name": "f"}]), "params.tools.0.input_schema", "is required"),
        (request(tools=[{"type": "web_search_20250305", "name": "s"}]), "params.tools.0.type", "not served"),
        (request(tool_choice={"type": "sometimes"}), "params.tool_choice", "auto, any, tool or none"),
        (request(tool_choice={"type": "tool"}), "params.tool_choice.name", "is required"),
        (request(metadata="me"), "params.metadata", "must be an object"),
    ],
)
def test_a_request_that_cannot_run_is_refused_naming_the_field(value: Any, field: str, words: str) -> None:
    refused = refusal(value)

    assert refused.field == field
    assert words in refused.message


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("not an object", ""),
        ({"custom_id": "req 1", "params": {}}, "custom_id"),
        ({"custom_id": "ok", "params": {}, "extra": 1}, "extra"),
        ({"custom_id": "ok", "params": ["max_tokens"]}, "params"),
    ],
)
def test_only_a_request_that_is_not_custom_id_and_params_is_refused_before_its_params_are_read(
    value: Any, field: str
) -> None:
    with pytest.raises(RequestRefused) as refused:
        request_parts(value)

    assert refused.value.field == field
    assert request_parts(request(max_tokens=-1, thinking={})) == (
        "req-1",
        request(max_tokens=-1, thinking={})["params"],
    )


@pytest.mark.parametrize("name", ["temperature", "top_p", "top_k"])
def test_sampling_params_are_refused_under_2026_10_21_and_taken_under_2023_06_01(name: str) -> None:
    refused = refusal(request(**{name: 0.5}), NEW)

    assert refused.field == f"params.{name}"
    assert "Extra inputs are not permitted" in refused.message and OLD in refused.message
    assert convert(request(**{name: 0.5})).params[name] == 0.5


def test_engine_field_names_are_given_back_in_the_requests_words() -> None:
    assert anthropic_field("stop") == "stop_sequences"
    assert anthropic_field("parallel_tool_calls") == "tool_choice.disable_parallel_tool_use"
    assert anthropic_field("max_tokens") == "max_tokens"
    assert anthropic_field("tools") == "tools"
