"""Which params each engine honours: a field an engine cannot honour is refused by name, never dropped."""

from __future__ import annotations

from typing import Any

import pytest

from gpuworkers.engines.request_params import PLATFORM_FIELDS, check_request_params
from gpuworkers.engines.sampling import ParamError
from portal.jobs.services.request_checks import PLATFORM_PARAMS

JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}


def _refused(engine: str, task: str, params: dict[str, Any]) -> ParamError:
    with pytest.raises(ParamError) as refused:
        check_request_params(engine, task, params)
    return refused.value


def test_the_platform_fields_are_the_ones_the_portal_reads_when_it_sends_shards() -> None:
    assert set(PLATFORM_PARAMS) == PLATFORM_FIELDS


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_every_engine_takes_the_sampling_basics_and_the_platform_fields(engine: str) -> None:
    check_request_params(
        engine,
        "chat",
        {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"], "micro_batch_size": 4},
    )


def test_vllm_takes_structured_output_and_transformers_refuses_it_naming_response_format() -> None:
    check_request_params("vllm", "chat", {"response_format": JSON_SCHEMA})
    refused = _refused("transformers", "chat", {"response_format": JSON_SCHEMA})
    assert refused.field == "response_format"
    assert "vllm engine" in str(refused)


def test_a_field_no_engine_reads_is_refused_with_what_the_engine_takes() -> None:
    refused = _refused("vllm", "generate", {"max_tokens": 4, "best_of": 2})
    assert refused.field == "best_of"
    assert "takes" in str(refused) and "max_tokens" in str(refused)


def test_tools_are_taken_by_vllm_for_decoded_calls_and_refused_elsewhere() -> None:
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    check_request_params("vllm", "chat", {"tools": tools, "tool_choice": "required"})
    assert _refused("vllm", "chat", {"tools": tools}).field == "tool_choice"
    check_request_params("vllm", "chat", {"tools": tools}, tool_parser="hermes")
    check_request_params("vllm", "chat", {"tools": tools, "tool_choice": "auto"}, tool_parser="hermes")
    elsewhere = _refused("transformers", "chat", {"tools": tools, "tool_choice": "required"})
    assert elsewhere.field == "tools" and "vllm engine" in str(elsewhere)
    assert _refused("vllm", "generate", {"tools": tools}).field == "tools"


def test_a_value_out_of_range_names_its_field_and_a_null_is_left_out() -> None:
    assert _refused("vllm", "chat", {"temperature": 3}).field == "temperature"
    check_request_params("vllm", "chat", {"temperature": None, "logit_bias": None})


def test_embedding_engines_take_dimensions_but_not_sampling() -> None:
    check_request_params("sentence_transformers", "embed", {"dimensions": 128, "encoding_format": "base64"})
    assert _refused("vllm", "embed", {"temperature": 0.5}).field == "temperature"


def test_user_code_reads_what_it_likes() -> None:
    check_request_params("python", "generate", {"anything": [1, 2, 3]})
