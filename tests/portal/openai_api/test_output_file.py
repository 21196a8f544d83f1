"""A Batchery job's output to OpenAI's batch output and error files (`portal.openai_api.formats.output_file`); no
database."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from openai.types import Completion, CreateEmbeddingResponse, ModerationCreateResponse
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict

from portal.openai_api.formats.output_file import OutputCounts, convert_outputs, system_fingerprint

EMBEDDINGS, COMPLETIONS, CHAT = "/v1/embeddings", "/v1/completions", "/v1/chat/completions"


class _RequestResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict[str, Any]


class _RequestError(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    message: str


class BatchRequestOutput(BaseModel):
    """One line of an OpenAI batch output or error file, as OpenAI's API reference specifies it
    (the openai package has no model for it)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    custom_id: str
    response: _RequestResponse | None
    error: _RequestError | None


@dataclass
class Converted:
    counts: OutputCounts
    output: bytes
    errors: bytes

    def lines(self, which: Literal["output", "errors"]) -> list[dict[str, Any]]:
        parsed = [orjson.loads(line) for line in getattr(self, which).splitlines()]
        for line in parsed:
            BatchRequestOutput.model_validate(line)
            assert line.keys() == {"id", "custom_id", "response", "error"}
        return parsed


def convert_out(
    records: list[dict[str, Any]], *, endpoint: str = EMBEDDINGS, batch_id: str = "batch_1", **options: Any
) -> Converted:
    output, errors = io.BytesIO(), io.BytesIO()
    source = [orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE) for record in records]
    counts = convert_outputs(
        source, output, errors, endpoint=endpoint, model="my-model", batch_id=batch_id, created=1700000000, **options
    )
    return Converted(counts, output.getvalue(), errors.getvalue())


def embedded(custom_id: str, vector: list[float], tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": custom_id, "response": {"embedding": vector, "usage": {"prompt_tokens": tokens}}}


def generated(custom_id: str, text: str, **extra: Any) -> dict[str, Any]:
    response = {"text": text, "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    return {"custom_id": custom_id, "response": {**response, **extra}}


def failed(custom_id: str, code: str, message: str = "it broke") -> dict[str, Any]:
    return {"custom_id": custom_id, "error": {"code": code, "message": message}}


def test_embeddings_become_create_embedding_responses() -> None:
    converted = convert_out([embedded("a", [0.5, -1.25, 3.0], tokens=7), embedded("b", [1.0, 2.0, 4.0])])

    assert converted.counts == OutputCounts(completed=2, failed=0)
    assert converted.errors == b""
    first, second = converted.lines("output")
    assert first["custom_id"] == "a"
    assert first["error"] is None
    assert first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1.25, 3.0]}],
        "model": "my-model",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    parsed = CreateEmbeddingResponse.model_validate(body)
    assert parsed.data[0].embedding == [0.5, -1.25, 3.0]
    assert CreateEmbeddingResponse.model_validate(second["response"]["body"]).usage.total_tokens == 4


def test_base64_embeddings_are_little_endian_float32_as_openai_encodes_them() -> None:
    vector = [0.5, -1.25, 3.0, 1e-3]

    converted = convert_out([embedded("a", vector)], encoding_format="base64")

    [line] = converted.lines("output")
    encoded = line["response"]["body"]["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == np.asarray(vector, dtype=np.float32).tolist()


def test_a_request_of_several_texts_gets_one_item_a_text_in_order_in_either_encoding() -> None:
    vectors = [[0.5, -1.25], [3.0, 1e-3], [-2.0, 0.25]]
    record = {"custom_id": "many", "response": {"embeddings": vectors, "usage": {"prompt_tokens": 12}}}

    [as_floats] = convert_out([record]).lines("output")
    [as_base64] = convert_out([record], encoding_format="base64").lines("output")

    body = CreateEmbeddingResponse.model_validate(as_floats["response"]["body"])
    assert [(item.index, item.embedding) for item in body.data] == list(enumerate(vectors))
    assert (body.usage.prompt_tokens, body.usage.total_tokens) == (12, 12)
    items = as_base64["response"]["body"]["data"]
    assert [item["index"] for item in items] == [0, 1, 2]
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist() for item in items]
    assert decoded == np.asarray(vectors, dtype=np.float32).tolist()


def test_an_unknown_encoding_format_is_refused() -> None:
    with pytest.raises(ValueError, match="encoding_format"):
        convert_out([embedded("a", [1.0])], encoding_format="int8")


ZERO_DETAILS = {
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {
        "reasoning_tokens": 0,
        "audio_tokens": 0,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    },
}


def test_the_prompt_tokens_a_prefix_cache_served_are_the_chat_completions_cached_tokens() -> None:
    usage = {"prompt_tokens": 1030, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1008}}
    record = {"custom_id": "a", "response": {"text": "Hi", "finish_reason": "stop", "usage": usage}}

    [line] = convert_out([record], endpoint=CHAT).lines("output")

    parsed = ChatCompletion.model_validate(line["response"]["body"])
    assert parsed.usage is not None and parsed.usage.prompt_tokens_details is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.prompt_tokens_details.cached_tokens) == (1030, 1008)


def test_chat_responses_become_chat_completions() -> None:
    converted = convert_out(
        [generated("a", "Hello!")], endpoint=CHAT, system_fingerprint=system_fingerprint("vllm", "my-model", "3")
    )

    [line] = converted.lines("output")
    body = line["response"]["body"]
    assert body["id"].startswith("chatcmpl-")
    assert body == {
        "id": body["id"],
        "object": "chat.completion",
        "created": 1700000000,
        "model": "my-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, **ZERO_DETAILS},
        "system_fingerprint": "batchery-vllm-my-model@3",
    }
    parsed = ChatCompletion.model_validate(body)
    assert parsed.system_fingerprint == "batchery-vllm-my-model@3"
    assert parsed.choices[0].message.content == "Hello!"
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 7


def test_chat_samples_and_logprobs_become_choices_with_openai_logprobs() -> None:
    content = [
        {"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Hi", "logprob": -0.1}]},
        {"token": "!", "logprob": None, "top_logprobs": [{"token": ".", "logprob": -0.3}]},
    ]
    choices = [
        {"index": 0, "text": "Hi!", "finish_reason": "stop", "logprobs": {"content": content}},
        {"index": 1, "text": "Hello there", "finish_reason": "length", "logprobs": {"content": content[:1]}},
    ]
    record = generated("a", "Hi!", logprobs={"content": content}, choices=choices)

    converted = convert_out([record], endpoint=CHAT)

    body = converted.lines("output")[0]["response"]["body"]
    parsed = ChatCompletion.model_validate(body)
    assert [(c.index, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "Hi!", "stop"),
        (1, "Hello there", "length"),
    ]
    first = parsed.choices[0].logprobs
    assert first is not None
    assert first.content is not None
    assert [(t.token, t.logprob) for t in first.content] == [("Hi", -0.1), ("!", -9999.0)]
    assert [(t.token, t.logprob) for t in first.content[1].top_logprobs] == [(".", -0.3)]
    assert body["choices"][0]["logprobs"]["content"][0] == {
        "token": "Hi",
        "logprob": -0.1,
        "bytes": None,
        "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": None}],
    }


def test_completion_responses_become_text_completions() -> None:
    converted = convert_out([generated("a", " upon a time")], endpoint=COMPLETIONS)

    body = converted.lines("output")[0]["response"]["body"]
    assert body["id"].startswith("cmpl-")
    assert body == {
        "id": body["id"],
        "object": "text_completion",
        "created": 1700000000,
        "model": "my-model",
        "choices": [{"text": " upon a time", "index": 0, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, **ZERO_DETAILS},
        "system_fingerprint": None,
    }
    assert Completion.model_validate(body).choices[0].text == " upon a time"


def test_completion_logprobs_take_the_completions_column_shape() -> None:
    content = [
        {
            "token": "ab",
            "logprob": -0.5,
            "top_logprobs": [{"token": "ab", "logprob": -0.5}, {"token": "x", "logprob": -2}],
        },
        {"token": "c", "logprob": -1.0, "top_logprobs": [{"token": "d", "logprob": -0.7}]},
    ]
    choices = [
        {"index": 0, "text": "abc", "finish_reason": "length", "logprobs": {"content": content}},
        {"index": 1, "text": "q", "finish_reason": "stop"},
    ]
    record = generated("a", "abc", logprobs={"content": content}, choices=choices)

    converted = convert_out([record], endpoint=COMPLETIONS)

    body = converted.lines("output")[0]["response"]["body"]
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["ab", "c"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"ab": -0.5, "x": -2.0}, {"d": -0.7}],
        "text_offset": [0, 2],
    }
    parsed = Completion.model_validate(body)
    assert [(choice.index, choice.text, choice.logprobs) for choice in parsed.choices][1] == (1, "q", None)


@pytest.mark.parametrize(
    ("code", "openai_code"),
    [("cancelled", "batch_cancelled"), ("expired", "batch_expired"), ("budget_exceeded", "budget_exceeded")],
)
def test_records_that_never_ran_get_no_response_and_openai_batch_error(code: str, openai_code: str) -> None:
    converted = convert_out([embedded("a", [1.0]), failed("b", code, f"the job was {code} before this record ran")])

    assert converted.counts == OutputCounts(completed=1, failed=1)
    assert [line["custom_id"] for line in converted.lines("output")] == ["a"]
    [line] = converted.lines("errors")
    assert line["custom_id"] == "b"
    assert line["response"] is None
    assert line["error"]["code"] == openai_code
    assert line["error"]["message"]


@pytest.mark.parametrize(
    ("code", "status", "error_type"),
    [
        ("engine_error", 400, "invalid_request_error"),
        ("out_of_memory", 500, "server_error"),
        ("poison_record", 500, "server_error"),
        ("shard_failed", 500, "server_error"),
        ("something_new", 500, "server_error"),
    ],
)
def test_records_that_failed_get_an_error_response(code: str, status: int, error_type: str) -> None:
    converted = convert_out([failed("a", code, "ValueError: the input is an empty string")], endpoint=CHAT)

    assert converted.counts == OutputCounts(completed=0, failed=1)
    assert converted.output == b""
    [line] = converted.lines("errors")
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == status
    assert response["request_id"]
    assert response["body"] == {
        "error": {
            "message": "ValueError: the input is an empty string",
            "type": error_type,
            "param": None,
            "code": code,
        }
    }


def test_output_lines_keep_input_order_and_split_between_the_two_files() -> None:
    records = [
        generated("a", "1"),
        failed("b", "engine_error"),
        generated("c", "3"),
        failed("d", "expired"),
        generated("e", "5"),
    ]

    converted = convert_out(records, endpoint=COMPLETIONS)

    assert converted.counts == OutputCounts(completed=3, failed=2)
    assert [line["custom_id"] for line in converted.lines("output")] == ["a", "c", "e"]
    assert [line["custom_id"] for line in converted.lines("errors")] == ["b", "d"]


def test_blank_output_lines_are_skipped() -> None:
    output, errors = io.BytesIO(), io.BytesIO()
    source = [b"\n", orjson.dumps(embedded("a", [1.0])) + b"\n", b"\n"]

    counts = convert_outputs(source, output, errors, endpoint=EMBEDDINGS, model="m", batch_id="b", created=0)

    assert counts == OutputCounts(completed=1, failed=0)


def test_ids_are_deterministic_from_the_batch_and_the_custom_id() -> None:
    records = [generated("a", "x"), generated("b", "y"), failed("c", "engine_error"), failed("d", "cancelled")]

    once = convert_out(records, endpoint=CHAT)
    twice = convert_out(records, endpoint=CHAT)
    other_batch = convert_out(records, endpoint=CHAT, batch_id="batch_2")

    assert (once.output, once.errors) == (twice.output, twice.errors)
    lines = once.lines("output") + once.lines("errors")
    ids = [line["id"] for line in lines]
    assert all(ident.startswith("batch_req_") for ident in ids)
    assert len(set(ids)) == 4
    request_ids = [line["response"]["request_id"] for line in lines if line["response"] is not None]
    completion_ids = [line["response"]["body"]["id"] for line in once.lines("output")]
    assert len(set(ids) | set(request_ids) | {ident.removeprefix("chatcmpl-") for ident in completion_ids}) == 9
    other_ids = {line["id"] for line in other_batch.lines("output") + other_batch.lines("errors")}
    assert not other_ids & set(ids)


def test_the_vllm_engines_responses_convert_to_valid_openai_bodies() -> None:
    """The contract with the engine: its responses, written as a shard writes them, convert and validate."""
    from gpuworkers.engines.vllm_outputs import completion_response, embedding_response

    @dataclass
    class Logprob:
        logprob: float
        decoded_token: str

    @dataclass
    class Sample:
        index: int
        text: str
        token_ids: list[int]
        finish_reason: str
        logprobs: list[dict[int, Logprob]]
        stop_reason: int | str | None = None

    @dataclass
    class Output:
        prompt_token_ids: list[int]
        outputs: Any

    @dataclass
    class Embedding:
        embedding: list[float]

    positions = [{5: Logprob(-0.1, "a"), 9: Logprob(-2.5, "z")}, {6: Logprob(-0.2, "b")}]
    samples = [Sample(0, "ab", [5, 6], "stop", positions), Sample(1, "ab", [5, 6], "length", positions)]
    generation = completion_response(Output([1, 2, 3], samples), top_logprobs=2)
    embedding = embedding_response(Output([1, 2], Embedding([0.25, 0.5])))

    def shard_line(custom_id: str, response: dict[str, Any]) -> dict[str, Any]:
        raw = orjson.dumps({"custom_id": custom_id, "response": response}, option=orjson.OPT_SERIALIZE_NUMPY)
        return dict(orjson.loads(raw))

    chat = convert_out([shard_line("a", generation)], endpoint=CHAT).lines("output")[0]["response"]["body"]
    text = convert_out([shard_line("a", generation)], endpoint=COMPLETIONS).lines("output")[0]["response"]["body"]
    vector = convert_out([shard_line("a", embedding)]).lines("output")[0]["response"]["body"]

    assert len(ChatCompletion.model_validate(chat).choices) == 2
    assert Completion.model_validate(text).choices[0].logprobs is not None
    assert CreateEmbeddingResponse.model_validate(vector).data[0].embedding == [0.25, 0.5]
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, **ZERO_DETAILS}


def test_tool_calls_become_the_messages_tool_calls_with_stable_ids_and_no_content() -> None:
    calls = [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}, {"name": "get_time", "arguments": "{}"}]
    record = generated("a", "", tool_calls=calls, finish_reason="tool_calls")

    first = convert_out([record], endpoint=CHAT).lines("output")[0]["response"]["body"]
    again = convert_out([record], endpoint=CHAT).lines("output")[0]["response"]["body"]

    completion = ChatCompletion.model_validate(first)
    [choice] = completion.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None
    assert [(call.function.name, call.function.arguments) for call in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]
    ids = [call.id for call in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(call_id.startswith("call_") for call_id in ids)
    assert first == again


def test_text_that_came_with_tool_calls_is_the_messages_content() -> None:
    calls = [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    record = generated("a", "Let me look that up.", tool_calls=calls, finish_reason="tool_calls")

    body = convert_out([record], endpoint=CHAT).lines("output")[0]["response"]["body"]

    [choice] = ChatCompletion.model_validate(body).choices
    assert choice.message.content == "Let me look that up." and choice.message.tool_calls is not None


def test_a_classification_becomes_a_moderation_result_over_every_openai_category() -> None:
    record = {"custom_id": "a", "response": {"scores": {"hate": 0.7, "violence": 0.2}, "label": "hate", "usage": {}}}

    body = convert_out([record], endpoint="/v1/moderations").lines("output")[0]["response"]["body"]

    [result] = ModerationCreateResponse.model_validate(body).results
    assert result.flagged and result.categories.hate and not result.categories.violence
    assert result.category_scores.violence == pytest.approx(0.2)
    assert result.category_applied_input_types.hate == ["text"]
    assert result.category_applied_input_types.sexual == [] and not result.categories.sexual


def test_a_model_scoring_no_moderation_category_gives_each_request_an_error_naming_its_labels() -> None:
    record = {"custom_id": "a", "response": {"scores": {"positive": 0.9, "negative": 0.1}, "label": "positive"}}

    converted = convert_out([record], endpoint="/v1/moderations")

    [line] = converted.lines("errors")
    error = line["response"]["body"]["error"]
    assert line["response"]["status_code"] == 400 and error["code"] == "invalid_model"
    assert "negative, positive" in error["message"] and "label_map" in error["message"]
