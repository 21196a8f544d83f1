"""Each line of a batch runs with its own body's params, as OpenAI runs each request on its own.

The official client uploads a batch whose lines differ in ``max_tokens``, ``temperature``, ``seed`` and
``response_format``; every answer must be what the engine gives that line's prompt and params alone. A line
asking for what its model's engine cannot do is refused before anything runs, naming the line and the field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from gpuworkers.engines.transformers import TransformersEngine
from portal.catalog.models import Model
from tests.api.conftest import Caller
from tests.support.openai_batches import batch_lines, openai_client, requests_file, run_batch

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

# Every line differs from every other, so the worker runs each prompt on its own, as the direct run does.
LINE_PARAMS: list[dict[str, Any]] = [
    {"max_tokens": 6},
    {"max_tokens": 3, "temperature": 0},
    {"max_tokens": 9, "temperature": 0.9, "seed": 11},
    {"max_tokens": 9, "temperature": 0.9, "seed": 12},
    {"max_tokens": 5, "response_format": {"type": "text"}, "seed": None},
    {"max_completion_tokens": 4, "top_p": 0.5, "temperature": 1.3, "seed": 5},
]


CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"


def _direct_answers(model: Model, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the engine gives each body's messages and params, one request a call, in this process."""
    engine = TransformersEngine(model.to_spec())
    engine.load(device="cpu")
    try:
        answers = []
        for body in bodies:
            params = {name: value for name, value in body.items() if name not in ("model", "messages")}
            [answer] = engine.run_batch([body["messages"]], params)
            answers.append(answer)
        return answers
    finally:
        engine.unload()


def test_each_line_runs_with_its_own_params_as_the_engine_runs_it_alone(
    live_server: Any,
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    tiny_chat: Model,
    tmp_path: Path,
) -> None:
    client = openai_client(live_server, caller("acme").key)
    bodies = [
        {"model": tiny_chat.name, "messages": [{"role": "user", "content": f"Tell me about item {n}."}], **params}
        for n, params in enumerate(LINE_PARAMS)
    ]
    batch = run_batch(client, requests_file(tmp_path / "params.jsonl", CHAT, bodies), CHAT, pipeline_workers)

    assert batch.status == "completed", batch
    lines = {line["custom_id"]: line for line in batch_lines(client, batch.output_file_id)}
    expected = _direct_answers(tiny_chat, bodies)
    for n, (params, answer) in enumerate(zip(LINE_PARAMS, expected, strict=True)):
        completion = openai.types.chat.ChatCompletion.model_validate(lines[f"req-{n}"]["response"]["body"])
        [choice] = completion.choices
        assert (choice.message.content, choice.finish_reason) == (answer["text"], answer["finish_reason"]), params
        assert completion.usage is not None
        assert completion.usage.completion_tokens == answer["usage"]["completion_tokens"], params
        assert completion.system_fingerprint == f"batchery-transformers-{tiny_chat.name}@{tiny_chat.version}"
    usages = [lines[f"req-{n}"]["response"]["body"]["usage"] for n in range(len(LINE_PARAMS))]
    assert batch.usage is not None
    assert batch.usage.input_tokens == sum(usage["prompt_tokens"] for usage in usages)
    assert batch.usage.output_tokens == sum(usage["completion_tokens"] for usage in usages)
    # The limits differ line by line, so the answers' lengths do too: the lines did not share one set of params.
    assert {lines[f"req-{n}"]["response"]["body"]["usage"]["completion_tokens"] for n in (0, 1, 2)} == {6, 3, 9}


def test_a_line_asking_for_a_json_schema_on_an_engine_without_structured_output_is_refused_by_line_and_field(
    live_server: Any,
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    tiny_chat: Model,
    tmp_path: Path,
) -> None:
    client = openai_client(live_server, caller("acme").key)
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    bodies = [
        {"model": tiny_chat.name, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3},
        {"model": tiny_chat.name, "messages": [{"role": "user", "content": "JSON?"}], "response_format": schema},
        {"model": tiny_chat.name, "messages": [{"role": "user", "content": "Tools?"}], "logprobs": True},
    ]
    batch = run_batch(client, requests_file(tmp_path / "refused.jsonl", CHAT, bodies), CHAT, pipeline_workers)

    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    problems = {(error.line, error.param) for error in batch.errors.data}
    assert problems == {(2, "body.response_format"), (3, "body.logprobs")}
    assert all(error.code == "invalid_param" for error in batch.errors.data)
    assert "vllm engine" in next(error.message for error in batch.errors.data if error.line == 2)


def test_a_responses_batch_runs_each_input_as_a_conversation_and_answers_with_response_objects(
    live_server: Any,
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    tiny_chat: Model,
    tmp_path: Path,
) -> None:
    client = openai_client(live_server, caller("acme").key)
    bodies = [
        {"model": tiny_chat.name, "input": "Say something.", "max_output_tokens": 4},
        {"model": tiny_chat.name, "input": "Something else.", "instructions": "Be brief.", "max_output_tokens": 7},
        {
            "model": tiny_chat.name,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Parts"}]}],
            "max_output_tokens": 5,
        },
    ]
    batch = run_batch(
        client, requests_file(tmp_path / "responses.jsonl", RESPONSES, bodies), RESPONSES, pipeline_workers
    )

    assert batch.status == "completed", batch
    lines = {line["custom_id"]: line for line in batch_lines(client, batch.output_file_id)}
    as_chat = [
        {"model": tiny_chat.name, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4},
        {
            "model": tiny_chat.name,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Something else."}],
            "max_tokens": 7,
        },
        {"model": tiny_chat.name, "messages": [{"role": "user", "content": "Parts"}], "max_tokens": 5},
    ]
    for n, answer in enumerate(_direct_answers(tiny_chat, as_chat)):
        response = openai.types.responses.Response.model_validate(lines[f"req-{n}"]["response"]["body"])
        assert response.output_text == answer["text"]
        assert response.status == ("incomplete" if answer["finish_reason"] == "length" else "completed")
        assert response.usage is not None and response.usage.output_tokens == answer["usage"]["completion_tokens"]
