"""A chat job's output line as a line of Anthropic's message batch results."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import orjson

from portal.anthropic_api.formats.results import result_line

USAGE = {"prompt_tokens": 7, "completion_tokens": 3}


def result(line: dict[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = orjson.loads(result_line(line, batch_id="msgbatch_1", model="tiny-chat"))
    # What the SDK reads each line as: the shape is Anthropic's own.
    anthropic.types.messages.MessageBatchIndividualResponse.model_validate(converted)
    return converted


def test_a_reply_is_a_succeeded_message_of_text_with_usage() -> None:
    line = result({"custom_id": "a", "response": {"text": "Hi.", "finish_reason": "stop", "usage": USAGE}})

    message = line["result"]["message"]
    assert line["custom_id"] == "a" and line["result"]["type"] == "succeeded"
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == "tiny-chat"
    assert message["content"] == [{"type": "text", "text": "Hi."}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)
    assert message["usage"]["input_tokens"] == 7 and message["usage"]["output_tokens"] == 3


def test_prompt_tokens_served_from_a_shared_prefix_are_cache_reads_not_input_tokens() -> None:
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 5}}
    line = result({"custom_id": "a", "response": {"text": "Hi.", "finish_reason": "stop", "usage": usage}})

    counted = line["result"]["message"]["usage"]
    assert (counted["input_tokens"], counted["cache_read_input_tokens"], counted["output_tokens"]) == (2, 5, 3)


def test_a_record_that_ran_with_an_adapter_names_it_as_the_messages_model() -> None:
    response = {"text": "Hi.", "finish_reason": "stop", "usage": USAGE, "model": "support-bot@2"}
    assert result({"custom_id": "a", "response": response})["result"]["message"]["model"] == "support-bot@2"


def test_stop_reasons_follow_the_engines_finish_reason_and_stop_sequence() -> None:
    def reason(response: dict[str, Any]) -> tuple[str, str | None]:
        message = result({"custom_id": "a", "response": {"text": "x", "usage": USAGE, **response}})["result"]["message"]
        return message["stop_reason"], message["stop_sequence"]

    assert reason({"finish_reason": "length"}) == ("max_tokens", None)
    assert reason({"finish_reason": "stop", "stop_sequence": "\n\n"}) == ("stop_sequence", "\n\n")


def test_tool_calls_are_tool_use_blocks_with_their_arguments_parsed() -> None:
    calls = [{"name": "weather", "arguments": json.dumps({"city": "Oslo"})}]
    response = {"text": "", "tool_calls": calls, "finish_reason": "tool_calls", "usage": USAGE}

    message = result({"custom_id": "a", "response": response})["result"]["message"]

    assert message["stop_reason"] == "tool_use"
    (block,) = message["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("weather", {"city": "Oslo"})


def test_ids_are_the_same_on_every_read() -> None:
    line = {"custom_id": "a", "response": {"text": "Hi.", "finish_reason": "stop", "usage": USAGE}}

    assert result(line) == result(line)


def test_failed_records_are_errored_by_whose_fault_and_stopped_ones_canceled_or_expired() -> None:
    def outcome(code: str) -> dict[str, Any]:
        return result({"custom_id": "a", "error": {"code": code, "message": f"{code} happened"}})["result"]

    too_long = outcome("input_too_long")
    assert too_long["type"] == "errored"
    assert too_long["error"] == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "input_too_long happened"},
    }
    assert outcome("out_of_memory")["error"]["error"]["type"] == "api_error"
    assert outcome("cancelled") == {"type": "canceled"}
    assert outcome("expired") == {"type": "expired"}


def test_a_request_refused_at_creation_is_errored_as_an_invalid_request_with_its_own_message() -> None:
    message = "params.max_tokens: max_tokens must be a positive integer, not -1"
    line = result({"custom_id": "a", "error": {"code": "invalid_request", "message": message}})

    assert line == {
        "custom_id": "a",
        "result": {
            "type": "errored",
            "error": {"type": "error", "error": {"type": "invalid_request_error", "message": message}},
        },
    }
