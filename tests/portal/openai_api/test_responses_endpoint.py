"""`/v1/responses` batches: the Responses API's text form, run as chat and answered as ``Response`` objects."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest
from openai.types.responses import Response

from gpuworkers.engines.request_params import check_request_params
from gpuworkers.engines.sampling import ParamError
from portal.openai_api.formats.endpoints import endpoint_for
from portal.openai_api.formats.input_file import RequestConversion, convert_requests
from portal.openai_api.formats.output_file import convert_outputs

RESPONSES = "/v1/responses"


def _judge(engine: str) -> Any:
    def params_problem(model: str, params: Any) -> tuple[str, str] | None:
        try:
            check_request_params(engine, "chat", params)
        except ParamError as exc:
            return exc.field, str(exc)
        return None

    return params_problem


def convert(*bodies: dict[str, Any], engine: str = "vllm") -> tuple[RequestConversion, list[dict[str, Any]]]:
    lines = [
        orjson.dumps({"custom_id": f"r{n}", "method": "POST", "url": RESPONSES, "body": {"model": "m", **body}}) + b"\n"
        for n, body in enumerate(bodies)
    ]
    target = io.BytesIO()
    result = convert_requests(lines, target, endpoint=RESPONSES, max_line_bytes=1 << 20, params_problem=_judge(engine))
    return result, [orjson.loads(line) for line in target.getvalue().splitlines()]


def test_the_endpoint_runs_as_chat() -> None:
    assert endpoint_for(RESPONSES).task == "chat"


def test_input_and_instructions_become_a_conversation_and_params_take_chats_names() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    result, records = convert(
        {"input": "Hello", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.2},
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Part one, "}, {"type": "input_text", "text": "two"}],
                },
                {"type": "message", "role": "assistant", "content": "Yes?"},
                {"role": "user", "content": "Go on"},
            ],
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
        },
    )

    assert result.ok, result.problems
    assert result.params == {"max_tokens": 20, "temperature": 0.2}
    assert records[0] == {
        "custom_id": "r0",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    }
    assert records[1]["messages"] == [
        {"role": "user", "content": "Part one, two"},
        {"role": "assistant", "content": "Yes?"},
        {"role": "user", "content": "Go on"},
    ]
    assert records[1]["params"] == {
        "max_tokens": None,
        "temperature": None,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
    }


@pytest.mark.parametrize(
    ("body", "engine", "param"),
    [
        ({"input": "x", "max_output_tokens": 0}, "vllm", "body.max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "transformers", "body.text.format"),
        ({"input": "x", "truncation": "auto"}, "vllm", "body.truncation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "vllm", "body.tools"),
        ({"input": "x", "top_logprobs": 2}, "vllm", "body.top_logprobs"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "vllm", "body.input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "vllm",
            "body.input[0].content",
        ),
        ({"input": ""}, "vllm", "body.input"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_the_bodys_own_words(
    body: dict[str, Any], engine: str, param: str
) -> None:
    result, records = convert(body, engine=engine)

    assert records == []
    [problem] = result.problems
    assert (problem.line, problem.param) == (1, param)
    assert problem.message.startswith(param)


def test_truncation_auto_asks_the_transformers_engine_to_truncate() -> None:
    result, _ = convert({"input": "x", "truncation": "auto"}, engine="transformers")

    assert result.ok and result.params == {"truncate": True}


def _response_bodies(finish_reason: str) -> dict[str, Any]:
    record = {
        "custom_id": "a",
        "response": {
            "text": "Hi there",
            "finish_reason": finish_reason,
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        },
    }
    output, errors = io.BytesIO(), io.BytesIO()
    convert_outputs(
        [orjson.dumps(record) + b"\n"], output, errors, endpoint=RESPONSES, model="m", batch_id="b", created=1700000000
    )
    [line] = [orjson.loads(raw) for raw in output.getvalue().splitlines()]
    return dict(line["response"]["body"])


def test_a_reply_becomes_a_response_with_its_text_and_usage() -> None:
    body = _response_bodies("stop")

    response = Response.model_validate(body)
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == "Hi there"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (5, 2, 7)


def test_a_reply_cut_at_max_output_tokens_is_incomplete() -> None:
    response = Response.model_validate(_response_bodies("length"))

    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
