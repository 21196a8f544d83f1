"""The vllm engine's pure parts, which run everywhere: OpenAI fields to ``SamplingParams`` arguments, vLLM's
outputs to responses, and the arguments `vllm.LLM` is built with."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuworkers.engines import EngineLoadError
from gpuworkers.engines.sampling import sampling_kwargs
from gpuworkers.engines.vllm_load import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    embed_runner_kwargs,
    engine_kwargs,
    tensor_parallel_size,
)
from gpuworkers.engines.vllm_outputs import completion_response, embedding_response
from tests.support.vllm_standins import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    vllm_spec,
)

# sampling_kwargs


def test_openai_sampling_fields_map_to_sampling_params_arguments() -> None:
    params = {
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": "\n",
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -1,
    }

    assert sampling_kwargs(params) == {
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": ["\n"],
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
    }


def test_fields_left_out_or_null_keep_vllms_defaults_and_unknown_fields_are_ignored() -> None:
    assert sampling_kwargs({}) == {}
    assert sampling_kwargs({"max_tokens": None, "stop": None, "temperature": None}) == {}
    assert sampling_kwargs({"model": "gpt-4o", "user": "ann", "stream": False, "batch_size": 4}) == {}


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert sampling_kwargs({"max_tokens": 5, "max_completion_tokens": 9}) == {"max_tokens": 9}


def test_a_list_of_stop_strings_is_kept_and_an_empty_one_dropped() -> None:
    assert sampling_kwargs({"stop": ["a", "bc"]}) == {"stop": ["a", "bc"]}
    assert sampling_kwargs({"stop": []}) == {}


@pytest.mark.parametrize(
    ("params", "logprobs"),
    [
        ({"logprobs": True, "top_logprobs": 3}, 3),  # chat
        ({"logprobs": True}, 0),  # chat: the sampled token's logprob only
        ({"logprobs": False}, None),
        ({"logprobs": 2}, 2),  # completions
        ({"logprobs": 0}, 0),
    ],
)
def test_chat_and_completions_logprobs_both_become_a_number_of_alternatives(
    params: dict[str, Any], logprobs: int | None
) -> None:
    assert sampling_kwargs(params).get("logprobs") == logprobs


def test_vllms_own_fields_and_logit_bias_are_passed_on() -> None:
    params = {"top_k": 40, "repetition_penalty": 1.1, "logit_bias": {"50256": -100, 13: 5}}

    assert sampling_kwargs(params) == {"top_k": 40, "repetition_penalty": 1.1, "logit_bias": {50256: -100.0, 13: 5.0}}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("max_tokens", 8.0),
        ("max_completion_tokens", -1),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("seed", 1.5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("top_k", -2),
        ("repetition_penalty", 0),
        ("stop", ""),
        ("stop", ["a", 3]),
        ("stop", 5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", "yes"),
        ("top_logprobs", 21),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"5": 200}),
        ("logit_bias", [1, 2]),
    ],
)
def test_a_bad_value_raises_a_value_error_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        sampling_kwargs({field: value})


def test_top_logprobs_without_logprobs_true_is_refused() -> None:
    with pytest.raises(ValueError, match="top_logprobs"):
        sampling_kwargs({"top_logprobs": 2})
    with pytest.raises(ValueError, match="top_logprobs"):
        sampling_kwargs({"logprobs": 2, "top_logprobs": 2})


# Response shaping


def test_one_sample_gives_text_finish_reason_and_usage() -> None:
    output = RequestOutput([1, 2, 3], [CompletionOutput(0, " world", [7, 8], finish_reason="stop")])

    assert completion_response(output) == {
        "text": " world",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }


def test_a_sample_ended_by_a_stop_string_names_it_and_one_ended_by_a_stop_token_does_not() -> None:
    by_string = RequestOutput([1], [CompletionOutput(0, "a", [5], finish_reason="stop", stop_reason="\n\n")])
    by_token = RequestOutput([1], [CompletionOutput(0, "a", [5], finish_reason="stop", stop_reason=13)])

    assert completion_response(by_string)["stop_sequence"] == "\n\n"
    assert "stop_sequence" not in completion_response(by_token)


def test_the_prompt_tokens_vllm_served_from_its_prefix_cache_are_reported_as_cached_tokens() -> None:
    output = RequestOutput([1, 2, 3], [CompletionOutput(0, "a", [7], finish_reason="stop")], num_cached_tokens=2)

    assert completion_response(output)["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_several_samples_are_all_in_choices_and_all_their_tokens_are_counted() -> None:
    output = RequestOutput(
        [1, 2],
        [CompletionOutput(0, "a", [5], finish_reason="stop"), CompletionOutput(1, "bcd", [6, 7, 8], "length")],
    )

    response = completion_response(output)

    assert response["text"] == "a"
    assert response["finish_reason"] == "stop"
    assert response["choices"] == [
        {"index": 0, "text": "a", "finish_reason": "stop"},
        {"index": 1, "text": "bcd", "finish_reason": "length"},
    ]
    assert response["usage"] == {"prompt_tokens": 2, "completion_tokens": 4}


def test_logprobs_give_each_tokens_logprob_and_its_likeliest_alternatives() -> None:
    positions = [
        {5: Logprob(-0.1, 1, "a"), 9: Logprob(-2.5, 2, "z"), 4: Logprob(-3.0, 3, "q")},
        # The sampled token is not among the top alternatives here.
        {3: Logprob(-0.2, 1, "b"), 6: Logprob(-4.0, 7, "c")},
    ]
    output = RequestOutput([1], [CompletionOutput(0, "ac", [5, 6], logprobs=positions)])

    response = completion_response(output, top_logprobs=1)

    assert response["logprobs"] == {
        "content": [
            {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]},
            {"token": "c", "logprob": -4.0, "top_logprobs": [{"token": "b", "logprob": -0.2}]},
        ]
    }


def test_logprobs_are_left_out_when_not_asked_for() -> None:
    positions = [{5: Logprob(-0.1, 1, "a")}]
    output = RequestOutput([1], [CompletionOutput(0, "a", [5], logprobs=positions)])

    assert "logprobs" not in completion_response(output)


def test_a_prompt_without_token_ids_counts_zero_prompt_tokens() -> None:
    assert completion_response(RequestOutput(None, [CompletionOutput(0, "x", [1])]))["usage"]["prompt_tokens"] == 0


def test_a_request_without_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="no completion"):
        completion_response(RequestOutput([1], []))


def test_an_embedding_becomes_a_float32_array_with_its_prompt_tokens() -> None:
    response = embedding_response(EmbeddingRequestOutput([4, 5, 6, 7], EmbeddingOutput([0.5, -1.0, 2.0])))

    assert response["embedding"].dtype == np.float32
    assert response["embedding"].tolist() == [0.5, -1.0, 2.0]
    assert response["usage"] == {"prompt_tokens": 4}


# Load arguments


def test_tensor_parallel_size_is_the_slots_gpu_count_or_the_specs() -> None:
    spec = vllm_spec("/models/x", gpus_per_replica=2)

    assert tensor_parallel_size(spec, None) == 2
    assert tensor_parallel_size(spec, "2,3") == 2
    assert tensor_parallel_size(spec, "0,1,2,3") == 4


@pytest.mark.parametrize(("visible", "message"), [("", "empty"), (" ", "empty"), ("4", "needs 2 GPUs")])
def test_too_few_visible_gpus_is_a_load_error(visible: str, message: str) -> None:
    with pytest.raises(EngineLoadError, match=message):
        tensor_parallel_size(vllm_spec("/models/x", gpus_per_replica=2), visible)


def test_embeddings_ask_for_the_pooling_runner_in_the_words_of_the_vllm_at_hand() -> None:
    assert embed_runner_kwargs({"model", "runner", "convert", "task"}) == {"runner": "pooling"}
    assert embed_runner_kwargs({"model", "task"}) == {"task": "embed"}
    assert embed_runner_kwargs({"model"}) == {}


COMPACT_JSON = {"backend": "xgrammar", "disable_any_whitespace": True}


def test_engine_kwargs_default_dtype_context_and_memory_share_and_pass_the_rest_on() -> None:
    assert engine_kwargs({}) == {
        "dtype": "auto",
        "max_model_len": None,
        "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "disable_log_stats": False,
        "structured_outputs_config": COMPACT_JSON,
    }
    assert engine_kwargs({"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True}) == {
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "enforce_eager": True,
        "disable_log_stats": False,
        "structured_outputs_config": COMPACT_JSON,
    }


@pytest.mark.parametrize(
    ("load_params", "message"),
    [
        ({"model": "elsewhere"}, "set by the vllm engine"),
        ({"tensor_parallel_size": 8}, "set by the vllm engine"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"dtype": 16}, "dtype"),
    ],
)
def test_bad_load_params_are_load_errors(load_params: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineLoadError, match=message):
        engine_kwargs(load_params)
