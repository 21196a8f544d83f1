"""The vllm engine: its pure parts everywhere, its wiring against a stand-in vllm, the real vLLM on a GPU.

vLLM runs only on CUDA GPUs, so most of this file feeds the engine's pure functions and a stand-in
``vllm`` module with objects that have the attributes of vLLM's outputs (``RequestOutput``,
``CompletionOutput``, ``Logprob``, ``EmbeddingRequestOutput``). The tests at the end build a real
``vllm.LLM`` on a tiny GPT-2 and are skipped, saying why, where vllm or a GPU is missing.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuworkers.engines import EngineLoadError, create_engine
from gpuworkers.engines.sampling import sampling_kwargs
from gpuworkers.engines.vllm import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    VllmEngine,
    completion_response,
    embed_runner_kwargs,
    embedding_response,
    engine_kwargs,
    tensor_parallel_size,
)
from gpuworkers.spec import ModelSpec
from tests.support.tiny_models import build_tiny_causal_lm


def vllm_spec(source: Path | str, **changes: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": "tiny-gpt2",
        "version": "1",
        "engine": "vllm",
        "task": "generate",
        "source": str(source),
    }
    return ModelSpec(**{**fields, **changes})  # type: ignore[arg-type]


# Stand-ins with the attributes of vLLM's output objects (vllm/outputs.py, vllm/logprobs.py).


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = "length"
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


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


def test_engine_kwargs_default_dtype_context_and_memory_share_and_pass_the_rest_on() -> None:
    assert engine_kwargs({}) == {
        "dtype": "auto",
        "max_model_len": None,
        "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "disable_log_stats": False,
    }
    assert engine_kwargs({"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True}) == {
        "dtype": "bfloat16",
        "max_model_len": 4096,
        "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "enforce_eager": True,
        "disable_log_stats": False,
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


# The engine against a stand-in vllm module


class FakeLLM:
    """Records how the engine builds and calls `vllm.LLM`; answers like it, one output per prompt."""

    instances: list[FakeLLM] = []

    def __init__(self, model: str, *, runner: str = "auto", convert: str = "auto", **kwargs: Any) -> None:
        self.kwargs: dict[str, Any] = {"model": model, "runner": runner, **kwargs}
        self.calls: list[tuple[str, list[Any], Any]] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts: list[str], sampling_params: Any = None, *, use_tqdm: bool = True) -> list[Any]:
        self.calls.append(("generate", prompts, sampling_params))
        return [RequestOutput(list(range(len(p))), [CompletionOutput(0, p.upper(), [1, 2])]) for p in prompts]

    def chat(
        self, messages: list[Any], sampling_params: Any = None, use_tqdm: bool = True, tools: Any = None
    ) -> list[Any]:
        self.calls.append(
            ("chat", messages, sampling_params) if tools is None else ("chat", messages, sampling_params, tools)
        )
        return [RequestOutput([1] * len(m), [CompletionOutput(0, m[-1]["content"], [3])]) for m in messages]

    def embed(self, prompts: list[str], *, use_tqdm: bool = True) -> list[Any]:
        self.calls.append(("embed", prompts, None))
        return [EmbeddingRequestOutput([1] * len(p), EmbeddingOutput([float(len(p))])) for p in prompts]

    @property
    def llm_engine(self) -> Any:
        return types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=self.kwargs.get("max_model_len")))

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()


class FakeTokenizer:
    """One token a character, plus a start token; a chat renders as its contents joined by newlines."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [0] * (len(text) + add_special_tokens)}

    def apply_chat_template(self, messages: list[Any], *, add_generation_prompt: bool, tokenize: bool) -> str:
        return "\n".join(message["content"] for message in messages) + "\n"


@dataclass
class FakeSamplingParams:
    kwargs: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    module.SamplingParams = lambda **kwargs: FakeSamplingParams(kwargs)  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.StructuredOutputsParams = lambda **kwargs: ("structured", kwargs)  # type: ignore[attr-defined]
    module.sampling_params = sampling  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeLLM.instances.clear()
    yield module
    FakeLLM.instances.clear()


def loaded(spec: ModelSpec) -> tuple[VllmEngine, FakeLLM]:
    engine = VllmEngine(spec)
    engine.load(device="cuda")
    return engine, FakeLLM.instances[-1]


def test_the_registry_builds_this_engine_for_its_name() -> None:
    assert isinstance(create_engine(vllm_spec("/models/x")), VllmEngine)


def test_without_the_vllm_extra_loading_is_a_load_error_that_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, installed or not

    with pytest.raises(EngineLoadError, match="the vllm extra is not installed"):
        VllmEngine(vllm_spec(tmp_path)).load(device="cuda")


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_vllm_refuses_a_device_other_than_the_slots_gpus(tmp_path: Path, device: str) -> None:
    with pytest.raises(EngineLoadError, match="CUDA_VISIBLE_DEVICES"):
        VllmEngine(vllm_spec(tmp_path)).load(device=device)


def test_a_task_vllm_does_not_run_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(EngineLoadError, match="'classify'"):
        VllmEngine(vllm_spec(tmp_path, task="classify")).load(device="cuda")


def test_load_builds_one_llm_over_the_slots_gpus_with_the_catalogs_arguments(
    fake_vllm: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")

    _, llm = loaded(vllm_spec(tmp_path, gpus_per_replica=2, load_params={"enforce_eager": True}))

    assert llm.kwargs == {
        "model": str(tmp_path),
        "runner": "auto",
        "tensor_parallel_size": 2,
        "dtype": "auto",
        "max_model_len": None,
        "gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "enforce_eager": True,
        "disable_log_stats": False,
    }


def test_an_embedding_model_is_loaded_with_the_pooling_runner(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    _, llm = loaded(vllm_spec(tmp_path, task="embed"))

    assert llm.kwargs["runner"] == "pooling"


def test_a_failing_llm_constructor_is_a_load_error_naming_the_model(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    def refuse(**kwargs: Any) -> None:
        raise ValueError("unsupported architecture")

    fake_vllm.LLM = refuse  # type: ignore[attr-defined]

    with pytest.raises(EngineLoadError, match=r"'tiny-gpt2'.*unsupported architecture"):
        VllmEngine(vllm_spec(tmp_path)).load(device="cuda")


def test_a_missing_model_directory_is_a_load_error(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    with pytest.raises(EngineLoadError, match="no directory"):
        VllmEngine(vllm_spec(tmp_path / "absent")).load(device="cuda")


def test_a_micro_batch_of_prompts_goes_to_vllm_in_one_generate_call(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path))

    responses = engine.run_batch(["ab", "c", "def"], {"max_tokens": 4, "temperature": 0, "model": "ignored"})

    assert [call[:2] for call in llm.calls] == [("generate", ["ab", "c", "def"])]
    assert llm.calls[0][2] == [FakeSamplingParams({"max_tokens": 4, "temperature": 0.0})] * 3
    assert [response["text"] for response in responses] == ["AB", "C", "DEF"]
    assert [response["usage"] for response in responses] == [
        {"prompt_tokens": 2, "completion_tokens": 2},
        {"prompt_tokens": 1, "completion_tokens": 2},
        {"prompt_tokens": 3, "completion_tokens": 2},
    ]


def test_prompts_with_their_own_params_share_one_generate_call(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, llm = loaded(vllm_spec(tmp_path))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [
        {"max_tokens": 4, "temperature": 0},
        {"max_tokens": 9, "temperature": 0.7, "seed": 3},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}},
        {"response_format": {"type": "json_object"}},
    ]

    engine.run_requests(["a", "b", "c", "d"], params)

    [(kind, prompts, sampling)] = llm.calls
    assert (kind, prompts) == ("generate", ["a", "b", "c", "d"])
    assert sampling == [
        FakeSamplingParams({"max_tokens": 4, "temperature": 0.0}),
        FakeSamplingParams({"max_tokens": 9, "temperature": 0.7, "seed": 3}),
        FakeSamplingParams({"structured_outputs": ("structured", {"json": schema})}),
        FakeSamplingParams({"structured_outputs": ("structured", {"json_object": True})}),
    ]


def test_an_older_vllm_gets_structured_output_as_guided_decoding(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    legacy = types.ModuleType("vllm.sampling_params")
    legacy.GuidedDecodingParams = lambda **kwargs: ("guided", kwargs)  # type: ignore[attr-defined]
    fake_vllm.sampling_params = legacy  # type: ignore[attr-defined]
    engine, llm = loaded(vllm_spec(tmp_path, task="chat"))

    engine.run_batch([[{"role": "user", "content": "hi"}]], {"response_format": {"type": "json_object"}})

    assert llm.calls[0][2] == [FakeSamplingParams({"guided_decoding": ("guided", {"json_object": True})})]


def test_a_micro_batch_of_conversations_goes_to_vllm_in_one_chat_call(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task="chat"))
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
    ]

    responses = engine.run_batch(conversations, {"n": 1})

    assert [call[:2] for call in llm.calls] == [("chat", conversations)]
    assert [response["text"] for response in responses] == ["hi", "why?"]


def test_a_micro_batch_of_texts_goes_to_vllm_in_one_embed_call(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task="embed"))

    responses = engine.run_batch(["a", "bcd"], {})

    assert [call[:2] for call in llm.calls] == [("embed", ["a", "bcd"])]
    assert [response["embedding"].tolist() for response in responses] == [[1.0], [3.0]]
    assert [response["usage"] for response in responses] == [{"prompt_tokens": 1}, {"prompt_tokens": 3}]


@pytest.mark.parametrize(
    ("task", "bad_input", "message"),
    [
        ("generate", 42, "string"),
        ("generate", "", "empty"),
        ("embed", ["a"], "string"),
        ("chat", "hello", "list of messages"),
        ("chat", [], "list of messages"),
        ("chat", [{"content": "no role"}], "role"),
    ],
)
def test_a_bad_input_raises_a_value_error_before_vllm_is_called(
    fake_vllm: types.ModuleType, tmp_path: Path, task: str, bad_input: object, message: str
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task=task))

    with pytest.raises(ValueError, match=message):
        engine.run_batch([bad_input], {})
    assert llm.calls == []


def test_bad_sampling_params_fail_the_batch_before_vllm_is_called(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, llm = loaded(vllm_spec(tmp_path))

    with pytest.raises(ValueError, match="temperature"):
        engine.run_batch(["a"], {"temperature": -1})
    assert llm.calls == []


def test_an_empty_batch_calls_nothing(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, llm = loaded(vllm_spec(tmp_path))

    assert engine.run_batch([], {}) == []
    assert llm.calls == []


def test_unload_drops_the_llm(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, _ = loaded(vllm_spec(tmp_path))

    engine.unload()
    engine.unload()  # a second unload is harmless

    assert engine.memory_bytes() == 0
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.run_batch(["a"], {})


# The real vLLM, on a GPU

PROMPTS = ["Hello", "A much longer prompt than the others", "x", "Medium prompt"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


def require_vllm_on_a_gpu() -> None:
    pytest.importorskip("vllm", reason="vllm is not installed (the vllm extra goes on GPU hosts only)")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU and torch sees none")


def real_engine(directory: Path, task: str) -> VllmEngine:
    # A small memory share and no CUDA graphs: a tiny model, loaded quickly, beside whatever else runs.
    load_params = {"gpu_memory_utilization": 0.15, "enforce_eager": True, "max_model_len": 128}
    engine = VllmEngine(vllm_spec(directory, task=task, load_params=load_params))
    engine.load(device="cuda")
    return engine


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm_on_a_gpu()
    directory = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2-vllm"))
    from transformers import AutoTokenizer

    # The tiny tokenizer has no chat template, which LLM.chat needs.
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


# One class per task, so that each engine is unloaded (class-scoped fixture) before the next one loads.


class TestGenerateOnAGpu:
    @pytest.fixture(scope="class")
    def engine(self, gpu_model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(gpu_model_dir, "generate")
        yield engine
        engine.unload()

    def test_each_prompt_gets_one_completion_with_its_usage(self, engine: VllmEngine) -> None:
        responses = engine.run_batch(PROMPTS, {"max_tokens": 6, "temperature": 0})

        assert len(responses) == len(PROMPTS)
        for prompt, response in zip(PROMPTS, responses, strict=True):
            assert isinstance(response["text"], str)
            assert response["finish_reason"] in ("stop", "length")
            # The tiny tokenizer has one token per character and adds no special tokens.
            assert response["usage"]["prompt_tokens"] == len(prompt)
            assert 1 <= response["usage"]["completion_tokens"] <= 6

    def test_batched_greedy_completions_equal_one_at_a_time_in_input_order(self, engine: VllmEngine) -> None:
        alone = [engine.run_batch([prompt], {"max_tokens": 8, "temperature": 0})[0] for prompt in PROMPTS]

        assert engine.run_batch(PROMPTS, {"max_tokens": 8, "temperature": 0}) == alone

    def test_n_samples_come_back_as_choices(self, engine: VllmEngine) -> None:
        [response] = engine.run_batch(["Hello"], {"max_tokens": 4, "temperature": 1.0, "n": 3, "seed": 1})

        assert [choice["index"] for choice in response["choices"]] == [0, 1, 2]
        assert response["text"] == response["choices"][0]["text"]

    def test_logprobs_come_per_generated_token(self, engine: VllmEngine) -> None:
        params = {"max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        [response] = engine.run_batch(["Hello"], params)

        content = response["logprobs"]["content"]
        assert len(content) == response["usage"]["completion_tokens"]
        assert all(len(token["top_logprobs"]) == 2 for token in content)

    def test_the_engine_reports_its_share_of_the_gpu(self, engine: VllmEngine) -> None:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        assert engine.memory_bytes() == int(0.15 * total)


class TestChatOnAGpu:
    @pytest.fixture(scope="class")
    def engine(self, gpu_model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(gpu_model_dir, "chat")
        yield engine
        engine.unload()

    def test_each_conversation_gets_one_reply(self, engine: VllmEngine) -> None:
        conversations = [
            [{"role": "user", "content": "Hi"}],
            [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Why?"}],
        ]

        responses = engine.run_batch(conversations, {"max_tokens": 5, "temperature": 0})

        assert len(responses) == 2
        # The template renders "role: content\n" per message.
        assert [response["usage"]["prompt_tokens"] for response in responses] == [len("user: Hi\n"), 28]

    def test_each_reply_held_to_its_own_json_schema_parses_and_validates(self, engine: VllmEngine) -> None:
        import jsonschema

        schemas = [
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
                "required": ["ok", "tag"],
            },
        ]
        params = [
            {
                "max_tokens": 60,
                "temperature": 0.8,
                "seed": n,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{n}", "schema": schema}},
            }
            for n, schema in enumerate(schemas)
        ] + [{"max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}]
        conversations = [[{"role": "user", "content": f"Answer {n}"}] for n in range(len(params))]

        responses = engine.run_requests(conversations, params)

        for schema, response in zip(schemas, responses, strict=False):
            jsonschema.validate(json.loads(response["text"]), schema)
        assert isinstance(json.loads(responses[2]["text"]), dict)

    def test_required_tool_calls_come_back_as_calls_of_the_tools(self, engine: VllmEngine) -> None:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"],
                    },
                },
            }
        ]
        params = {
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 60,
            "temperature": 0,
        }

        [response] = engine.run_batch([[{"role": "user", "content": "Weather?"}]], params)

        assert response["finish_reason"] == "tool_calls"
        [call] = response["tool_calls"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)


class TestEmbedOnAGpu:
    @pytest.fixture(scope="class")
    def engine(self, gpu_model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(gpu_model_dir, "embed")
        yield engine
        engine.unload()

    def test_each_text_gets_one_embedding_of_the_models_width(self, engine: VllmEngine) -> None:
        responses = engine.run_batch(["Hello", "A longer text"], {})

        assert [response["embedding"].shape for response in responses] == [(32,), (32,)]
        assert [response["usage"]["prompt_tokens"] for response in responses] == [5, 13]


@pytest.mark.parametrize(
    ("task", "inputs", "expected"),
    [
        ("generate", ["x" * 11, "x" * 12], [None, "the prompt has 13 tokens; with max_tokens=8 it exceeds"]),
        ("chat", [[{"role": "user", "content": "y" * 12}]], ["the prompt has 13 tokens; with max_tokens=8 it exceeds"]),
        ("embed", ["z" * 19, "z" * 20], [None, "the input has 21 tokens; the model takes at most 20"]),
    ],
)
def test_an_input_over_max_model_len_is_measured_as_too_long(
    fake_vllm: types.ModuleType, tmp_path: Path, task: str, inputs: list[Any], expected: list[str | None]
) -> None:
    engine, _ = loaded(vllm_spec(tmp_path, task=task, load_params={"max_model_len": 20}))

    measured = engine.too_long(inputs, {"max_tokens": 8})

    assert len(measured) == len(expected)
    for message, want in zip(measured, expected, strict=True):
        assert message == want if want is None else message is not None and message.startswith(want)


def test_tool_calls_are_decoded_to_the_tools_schema_and_read_back_with_one_chat_call_per_tool_list(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task="chat"))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "other"}}
    # The fake answers each conversation with its last message, so these are the replies decoding gave.
    call = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    conversations = [
        [{"role": "user", "content": call}],
        [{"role": "user", "content": "plain"}],
        [{"role": "user", "content": '{"x": 1}'}],
    ]
    params = [
        {"tools": [weather], "tool_choice": "required"},
        {"max_tokens": 5},
        {"tools": [other], "tool_choice": {"type": "function", "function": {"name": "other"}}},
    ]

    first, plain, named = engine.run_requests(conversations, params)

    assert first["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert (first["finish_reason"], first["text"]) == ("tool_calls", "")
    assert plain["text"] == "plain" and "tool_calls" not in plain
    assert named["tool_calls"] == [{"name": "other", "arguments": '{"x": 1}'}]
    tools_by_call = [entry[3] if len(entry) > 3 else None for entry in llm.calls]
    assert sorted(map(str, tools_by_call)) == sorted(map(str, [[weather], None, [other]]))
    [required] = [entry[2][0] for entry in llm.calls if len(entry) > 3 and entry[3] == [weather]]
    schema = required.kwargs["structured_outputs"][1]["json"]
    assert schema["type"] == "array" and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
