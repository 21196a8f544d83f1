"""Tool calls by constrained decoding: the schema a reply is held to, and the calls read back from it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gpuworkers.engines.sampling import ParamError
from gpuworkers.engines.tools import reply_format, tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _refused(params: dict[str, Any]) -> ParamError:
    with pytest.raises(ParamError) as refused:
        tool_calls(params)
    return refused.value


def test_required_holds_the_reply_to_a_list_of_calls_of_the_tools_and_reads_them_back() -> None:
    calls = tool_calls({"tools": [WEATHER, TIME], "tool_choice": "required"})

    assert calls is not None and calls.named is None
    reply = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(reply, calls.schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "delete_all", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, calls.schema)
    assert calls.calls(json.dumps(reply)) == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"name": "get_time", "arguments": "{}"},
    ]


def test_parallel_tool_calls_false_allows_one_call() -> None:
    calls = tool_calls({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})

    assert calls is not None and calls.schema["maxItems"] == 1


def test_a_named_function_holds_the_reply_to_its_arguments() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    calls = tool_calls({"tools": [WEATHER, TIME], "tool_choice": choice})

    assert calls is not None and calls.named == "get_weather"
    assert calls.schema == WEATHER["function"]["parameters"]
    assert calls.calls('{"city": "Lima"}') == [{"name": "get_weather", "arguments": '{"city": "Lima"}'}]
    # A reply cut by max_tokens is not JSON: no calls, and the caller keeps its text.
    assert calls.calls('{"city": "Li') is None


def test_auto_with_the_models_tool_parser_leaves_the_reply_free_for_the_parser_to_read() -> None:
    for params in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        calls = tool_calls(params, tool_parser="hermes")
        assert calls is not None and (calls.parser, calls.schema, calls.named) == ("hermes", None, None)
        assert calls.tools == (WEATHER,)
        assert reply_format(params, calls) is None
    with pytest.raises(ParamError) as refused:
        reply_format({"response_format": {"type": "json_object"}}, tool_calls({"tools": [WEATHER]}, tool_parser="x"))
    assert refused.value.field == "response_format"


def test_none_and_no_tools_are_plain_text() -> None:
    assert tool_calls({}) is None
    assert tool_calls({"tools": [WEATHER], "tool_choice": "none"}) is None


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ({"tools": [WEATHER]}, "tool_choice", "'auto'"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "tool-call parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be one of"),
        ({"tools": [], "tool_choice": "required"}, "tools", "non-empty list"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools", "tools[0]"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}, "tools", "letters"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "no"},
            "parallel_tool_calls",
            "true or false",
        ),
    ],
)
def test_what_cannot_be_decoded_is_refused_naming_its_field(params: dict[str, Any], field: str, words: str) -> None:
    refused = _refused(params)

    assert refused.field == field and words in str(refused)


def test_a_response_format_beside_tool_calls_is_refused() -> None:
    params = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}

    with pytest.raises(ParamError) as refused:
        reply_format(params, tool_calls(params))

    assert refused.value.field == "response_format"
