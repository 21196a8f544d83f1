"""An OpenAI batch input file to a Batchery job's records (`portal.openai_api.formats.input_file`); no database."""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import FrozenInstanceError
from functools import partial
from typing import Any

import orjson
import pytest
from openai.types.batch import Errors

from portal.openai_api.formats.endpoints import ENDPOINTS, BatchEndpoint, UnsupportedEndpoint, endpoint_for
from portal.openai_api.formats.input_file import (
    RequestProblem,
    convert_requests,
    problems_to_openai_errors,
)
from tasks.shared.formats.records import TASK_INPUT_FIELDS
from tests.portal.openai_api.input_file_lines import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    INPUTS,
    MAX_LINE_BYTES,
    codes,
    convert,
    jsonl,
    request,
)

# The endpoint table


@pytest.mark.parametrize(
    ("url", "task", "input_field"),
    [(EMBEDDINGS, "embed", "input"), (COMPLETIONS, "generate", "prompt"), (CHAT, "chat", "messages")],
)
def test_each_endpoint_maps_to_its_task_and_input_field(url: str, task: str, input_field: str) -> None:
    endpoint = endpoint_for(url)

    assert endpoint == BatchEndpoint(url, task, input_field)
    # The record written carries the body's field under the same name: the task must read that name.
    assert TASK_INPUT_FIELDS[task] == input_field
    with pytest.raises(FrozenInstanceError):
        endpoint.task = "other"  # type: ignore[misc]


def test_an_unsupported_endpoint_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UnsupportedEndpoint, match=r"'/v1/images/generations' is not supported.*/v1/moderations"):
        endpoint_for("/v1/images/generations")
    with pytest.raises(ValueError, match="/v1/images/generations"):
        convert(jsonl(request()), endpoint="/v1/images/generations")
    assert set(ENDPOINTS) == {EMBEDDINGS, COMPLETIONS, CHAT, "/v1/responses", "/v1/moderations"}


# Good request files


@pytest.mark.parametrize("url", [EMBEDDINGS, COMPLETIONS, CHAT])
def test_a_good_file_becomes_records_with_the_model_and_the_shared_params(url: str) -> None:
    input_field, value = INPUTS[url]
    params = {"max_tokens": 20, "temperature": 0.5} if url != EMBEDDINGS else {"encoding_format": "base64"}
    lines = jsonl(*(request(f"r{n}", url=url, model="my-model", **params) for n in range(3)))

    result, records = convert(lines, endpoint=url)

    assert result.ok
    assert (result.model, result.params, result.records) == ("my-model", params, 3)
    assert (result.problems, result.problem_count) == ([], 0)
    assert records == [{"custom_id": f"r{n}", input_field: value} for n in range(3)]


def test_records_are_written_in_input_order_with_exactly_the_id_and_the_input() -> None:
    lines = jsonl(request("b", input="second"), request("a", input="first"))

    target = io.BytesIO()
    result = convert_requests(lines, target, endpoint=EMBEDDINGS, max_line_bytes=MAX_LINE_BYTES)

    assert (result.model, result.params, result.records) == ("m", {}, 2)
    assert target.getvalue() == b'{"custom_id":"b","input":"second"}\n{"custom_id":"a","input":"first"}\n'


@pytest.mark.parametrize(("url", "field"), [(EMBEDDINGS, "input"), (COMPLETIONS, "prompt")])
def test_a_list_of_one_text_is_unwrapped(url: str, field: str) -> None:
    line = request(url=url)
    line["body"][field] = ["only text"]

    result, records = convert(jsonl(line), endpoint=url)

    assert result.ok
    assert records == [{"custom_id": "r1", field: "only text"}]


def test_blank_lines_are_skipped_but_counted_in_line_numbers() -> None:
    lines = [b"\n", *jsonl(request("a")), b"   \n", b"\r\n", *jsonl(request("a"))]

    result, records = convert(lines)

    assert result.records == 1
    assert [record["custom_id"] for record in records] == ["a"]
    assert codes(result) == [(5, "duplicate_custom_id")]


def test_crlf_line_endings_and_a_last_line_without_newline_are_read() -> None:
    source = [orjson.dumps(request("a")) + b"\r\n", orjson.dumps(request("b"))]

    result, records = convert(source)

    assert result.ok
    assert [record["custom_id"] for record in records] == ["a", "b"]


def test_lines_may_come_in_pieces_of_any_size() -> None:
    data = b"".join(jsonl(request("a"), "", request("b"), "not json"))
    pieces = [data[i : i + 7] for i in range(0, len(data), 7)]

    result, records = convert(pieces)

    assert [record["custom_id"] for record in records] == ["a", "b"]
    assert codes(result) == [(4, "invalid_json")]


# Problems, one code at a time


@pytest.mark.parametrize(
    ("line", "code", "param", "message"),
    [
        ("{not json", "invalid_json", None, "not valid JSON"),
        ('["an", "array"]', "invalid_json", None, "must be a JSON object, not a list"),
        ({"method": "POST", "url": EMBEDDINGS, "body": {}}, "missing_custom_id", "custom_id", "custom_id is missing"),
        ({**request(), "custom_id": ""}, "missing_custom_id", "custom_id", "non-empty string, not ''"),
        ({**request(), "custom_id": 7}, "missing_custom_id", "custom_id", "non-empty string, not 7"),
        ({**request(), "method": "GET"}, "invalid_method", "method", "method must be 'POST', not 'GET'"),
        ({**request(), "method": None}, "invalid_method", "method", "method is missing"),
        (request(url=COMPLETIONS), "invalid_url", "url", "endpoint '/v1/embeddings', not '/v1/completions'"),
        ({**request(), "body": None}, "missing_body", "body", "body is missing"),
        ({**request(), "body": "text"}, "missing_body", "body", "body must be a JSON object, not 'text'"),
        ({**request(), "body": {"input": "x"}}, "missing_model", "body.model", "body.model is missing"),
        (request(model=""), "missing_model", "body.model", "body.model must be a model's name"),
        ({**request(), "body": {"model": "m"}}, "missing_input", "body.input", "body.input is missing"),
        (request(input=["a", 7]), "invalid_input", "body.input", "body.input must hold strings; item 2 is a number"),
        (
            request(input=[1, -2]),
            "invalid_input",
            "body.input",
            "body.input is a token array whose token 1 is negative",
        ),
        (request(input=[[1, 2], ["a"]]), "invalid_input", "body.input", "item 2 is an array of something else"),
        (request(input=[]), "invalid_input", "body.input", "not an empty array"),
        (request(input=None), "invalid_input", "body.input", "body.input must be a string, not null"),
        (request(dimensions=64), "invalid_param", "body.dimensions", "no model here declares Matryoshka"),
        ("x" * (MAX_LINE_BYTES + 1), "line_too_long", None, f"longer than {MAX_LINE_BYTES} bytes"),
    ],
)
def test_each_problem_has_its_code_line_param_and_message(
    line: dict[str, Any] | str, code: str, param: str | None, message: str
) -> None:
    result, records = convert(jsonl(request("first"), line))

    assert records == [{"custom_id": "first", "input": INPUTS[EMBEDDINGS][1]}]
    assert result.records == 1
    assert not result.ok
    assert result.problem_count == 1
    [problem] = result.problems
    assert (problem.line, problem.code, problem.param) == (2, code, param)
    assert message in problem.message
    assert str(problem) == f"line 2: {problem.message}"


def test_an_encoding_format_the_output_cannot_take_is_refused_on_every_line() -> None:
    result, records = convert(jsonl(request("a", encoding_format="int8"), request("b", encoding_format="int8")))

    assert records == []
    assert codes(result) == [(1, "invalid_param"), (2, "invalid_param")]
    assert result.problems[0].param == "body.encoding_format"
    assert "body.encoding_format must be 'float' or 'base64', not 'int8'" in result.problems[0].message


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "Hi",
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": "fine"}, "not a message"],
    ],
)
def test_chat_messages_must_be_a_non_empty_list_of_objects_with_role_and_content(messages: Any) -> None:
    result, records = convert(jsonl(request(url=CHAT, messages=messages)), endpoint=CHAT)

    assert records == []
    assert codes(result) == [(1, "invalid_input")]
    assert result.problems[0].param == "body.messages"
    assert "non-empty list of messages" in result.problems[0].message


def test_chat_content_may_be_a_list_of_parts() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]

    result, records = convert(jsonl(request(url=CHAT, messages=messages)), endpoint=CHAT)

    assert result.ok
    assert records == [{"custom_id": "r1", "messages": messages}]


def test_a_duplicate_custom_id_names_the_first_line_even_when_the_first_line_is_bad_otherwise() -> None:
    lines = jsonl(request("a", url=COMPLETIONS), request("a"), request("b"), request("a"))

    result, records = convert(lines)

    assert [record["custom_id"] for record in records] == ["b"]
    assert codes(result) == [(1, "invalid_url"), (2, "duplicate_custom_id"), (4, "duplicate_custom_id")]
    assert result.problems[1].message == "custom_id 'a' is already used on line 1; each request needs its own"


def test_mixed_models_are_refused_naming_both_models_and_the_first_line() -> None:
    lines = jsonl(request("a", model="small"), request("b", model="small"), request("c", model="large"))

    result, records = convert(lines)

    assert len(records) == 2
    assert codes(result) == [(3, "mixed_models")]
    message = result.problems[0].message
    assert "'large'" in message
    assert "line 1 runs on 'small'" in message
    assert result.model == "small"


def test_lines_may_name_adapters_of_the_batchs_model_each_record_keeping_its_adapter() -> None:
    bases = {"small": "small", "small-support": "small", "small-legal": "small", "large": "large"}
    lines = jsonl(
        request("a", model="small-support"),
        request("b", model="small"),
        request("c", model="small-legal"),
        request("d", model="large"),
    )

    result, records = convert(lines, base_model=bases.get)

    assert result.model == "small"
    assert [record.get("model") for record in records] == ["small-support", None, "small-legal"]
    assert codes(result) == [(4, "mixed_models")]
    assert "but line 1 runs on 'small'; a batch runs one model and its adapters" in result.problems[0].message


def test_the_first_good_line_sets_the_model_and_params_that_the_others_must_repeat() -> None:
    lines = jsonl(request("a", model="bad", input=7), request("b", model="good"), request("c", model="bad"))

    result, _ = convert(lines)

    assert codes(result) == [(1, "invalid_input"), (3, "mixed_models")]
    assert "line 2 runs on 'good'" in result.problems[1].message


def test_a_line_whose_params_differ_carries_its_own_with_null_for_what_it_leaves_out() -> None:
    lines = jsonl(
        request("a", url=CHAT, max_tokens=10, temperature=0.2),
        request("b", url=CHAT, max_tokens=10, temperature=0.2),
        request("c", url=CHAT, max_tokens=12, seed=3),
        request("d", url=CHAT, max_tokens=10, user="ann", stream=False),
    )

    result, records = convert(lines, endpoint=CHAT)

    assert result.ok
    assert result.params == {"max_tokens": 10, "temperature": 0.2}
    assert [record.get("params") for record in records] == [
        None,
        None,
        {"max_tokens": 12, "seed": 3, "temperature": None},
        {"max_tokens": 10, "temperature": None},
    ]


def test_lines_must_agree_on_encoding_format_which_shapes_the_whole_output_file() -> None:
    lines = jsonl(request("a", encoding_format="base64"), request("b"), request("c", encoding_format="base64"))

    result, records = convert(lines)

    assert codes(result) == [(2, "mixed_params")]
    assert result.problems[0].param == "body.encoding_format"
    assert "line 1's" in result.problems[0].message
    assert [record["custom_id"] for record in records] == ["a", "c"]


def test_a_streaming_request_is_refused() -> None:
    result, _ = convert(jsonl(request("a", url=CHAT, stream=True)), endpoint=CHAT)

    assert codes(result) == [(1, "invalid_param")]
    assert result.problems[0].param == "body.stream"


def test_each_lines_params_are_judged_against_its_models_engine_naming_the_line_and_field() -> None:
    judged: list[tuple[str, dict[str, Any]]] = []

    def params_problem(model: str, params: Mapping[str, Any]) -> tuple[str, str] | None:
        judged.append((model, dict(params)))
        if "response_format" in params:
            return "response_format", "response_format needs structured output"
        return None

    lines = jsonl(
        request("a", url=CHAT, max_tokens=3),
        request("b", url=CHAT, response_format={"type": "json_object"}, user="ann"),
    )

    result, records = convert(lines, endpoint=CHAT, params_problem=params_problem)

    assert codes(result) == [(2, "invalid_param")]
    assert result.problems[0].param == "body.response_format"
    assert result.problems[0].message == "body.response_format needs structured output"
    # Caller fields change no response: they are not the engine's to judge.
    assert judged == [("m", {"max_tokens": 3}), ("m", {"response_format": {"type": "json_object"}})]
    assert [record["custom_id"] for record in records] == ["a"]


def test_equal_numbers_are_the_same_param() -> None:
    lines = jsonl(request("a", url=COMPLETIONS, max_tokens=8), request("b", url=COMPLETIONS, max_tokens=8.0))
    result, _ = convert(lines, endpoint=COMPLETIONS)

    assert result.ok


def test_problems_stop_being_collected_at_max_problems_but_keep_being_counted() -> None:
    lines = jsonl(request("good"), *(["not json"] * 7), request("also-good"))

    result, records = convert(lines, max_problems=3)

    assert len(records) == 2
    assert result.problem_count == 7
    assert codes(result) == [(2, "invalid_json"), (3, "invalid_json"), (4, "invalid_json")]


def test_max_problems_defaults_to_twenty() -> None:
    result, _ = convert(jsonl(*(["{"] * 25)))

    assert (len(result.problems), result.problem_count) == (20, 25)


@pytest.mark.parametrize("source", [[], [b""], [b"\n", b"  \n"]])
def test_an_empty_file_is_one_problem_of_the_whole_file(source: list[bytes]) -> None:
    result, records = convert(source)

    assert records == []
    assert not result.ok
    assert (result.model, result.records, result.problem_count) == (None, 0, 1)
    [problem] = result.problems
    assert (problem.line, problem.code, problem.param) == (None, "empty_file", None)
    assert str(problem) == "the file holds no request"


def test_a_file_of_bad_lines_only_is_not_an_empty_file() -> None:
    result, _ = convert(jsonl("nope"))

    assert codes(result) == [(1, "invalid_json")]


def test_a_line_too_long_is_skipped_to_its_end_reading_bounded_pieces() -> None:
    long_request = request("long", input="x" * (3 * MAX_LINE_BYTES))
    stream = io.BytesIO(b"".join(jsonl(request("a"), long_request, request("b"))))
    pieces = iter(partial(stream.readline, MAX_LINE_BYTES + 1), b"")

    result, records = convert(pieces)

    assert [record["custom_id"] for record in records] == ["a", "b"]
    assert codes(result) == [(2, "line_too_long")]


def test_a_line_of_exactly_max_line_bytes_is_read_and_the_newline_does_not_count() -> None:
    line = orjson.dumps(request("a"))
    padded = line[:-1] + b" " * (MAX_LINE_BYTES - len(line)) + b"}"
    assert len(padded) == MAX_LINE_BYTES

    result, _ = convert([padded + b"\n", padded + b" \n"])

    assert codes(result) == [(2, "line_too_long")]


def test_a_last_line_too_long_without_newline_is_a_problem() -> None:
    result, _ = convert([*jsonl(request("a")), b"y" * (MAX_LINE_BYTES + 5)])

    assert codes(result) == [(2, "line_too_long")]


# Problems in OpenAI's shape


def test_problems_become_the_errors_object_of_an_openai_batch() -> None:
    result, _ = convert(jsonl(request("a"), request("b", model="other")))
    problems = [*result.problems, RequestProblem(None, "empty_file", "the file holds no request")]

    errors = problems_to_openai_errors(problems)

    assert errors == {
        "object": "list",
        "data": [
            {"code": "mixed_models", "message": result.problems[0].message, "param": "body.model", "line": 2},
            {"code": "empty_file", "message": "the file holds no request", "param": None, "line": None},
        ],
    }
    parsed = Errors.model_validate(errors)
    assert parsed.object == "list"
    assert parsed.data is not None
    assert [(error.code, error.line, error.param) for error in parsed.data] == [
        ("mixed_models", 2, "body.model"),
        ("empty_file", None, None),
    ]


def test_no_problems_give_an_empty_list() -> None:
    assert problems_to_openai_errors([]) == {"object": "list", "data": []}


def test_a_conversation_may_hold_tool_calls_and_their_results() -> None:
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]
    result, records = convert(jsonl(request("a", url=CHAT, messages=messages)), endpoint=CHAT)

    assert result.ok, result.problems
    assert records[0]["messages"] == messages
