"""The vllm engine's wiring, against a stand-in ``vllm`` (a CUDA build) that records how the engine builds and calls
``vllm.LLM``: what the real engine cannot show here (a GPU host's arguments, a failing or missing engine, calls
counted). What the engine answers is tested on the real vLLM, in `test_vllm_real.py`."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.engines import EngineLoadError, create_engine, grammar_gate
from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.sampling import ParamError
from gpuworkers.engines.vllm import VllmEngine
from gpuworkers.engines.vllm_load import DEFAULT_GPU_MEMORY_UTILIZATION
from gpuworkers.spec import ModelSpec
from tests.support import grammar_compilers
from tests.support.vllm_standins import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    vllm_spec,
)

# The engine against a stand-in vllm module


class FakeLLM:
    """Records how the engine builds and calls `vllm.LLM`; answers like it, one output per prompt."""

    instances: list[FakeLLM] = []

    def __init__(self, model: str, *, runner: str = "auto", convert: str = "auto", **kwargs: Any) -> None:
        self.kwargs: dict[str, Any] = {"model": model, "runner": runner, **kwargs}
        self.calls: list[tuple[str, list[Any], Any]] = []
        self.loras: list[Any] = []
        FakeLLM.instances.append(self)

    def generate(
        self, prompts: list[str], sampling_params: Any = None, *, use_tqdm: bool = True, lora_request: Any = None
    ) -> list[Any]:
        self.calls.append(("generate", prompts, sampling_params))
        self.loras.append(lora_request)
        return [RequestOutput(list(range(len(p))), [CompletionOutput(0, p.upper(), [1, 2])]) for p in prompts]

    def chat(
        self,
        messages: list[Any],
        sampling_params: Any = None,
        use_tqdm: bool = True,
        tools: Any = None,
        lora_request: Any = None,
    ) -> list[Any]:
        self.loras.append(lora_request)
        self.calls.append(
            ("chat", messages, sampling_params) if tools is None else ("chat", messages, sampling_params, tools)
        )
        return [RequestOutput([1] * len(m), [CompletionOutput(0, m[-1]["content"], [3])]) for m in messages]

    def embed(self, prompts: list[str | dict[str, list[int]]], *, use_tqdm: bool = True) -> list[Any]:
        self.calls.append(("embed", prompts, None))
        ids = [p["prompt_token_ids"] if isinstance(p, dict) else [1] * len(p) for p in prompts]
        return [EmbeddingRequestOutput(own, EmbeddingOutput([float(len(own))])) for own in ids]

    def enqueue(
        self, prompts: list[str], sampling_params: Any = None, *, use_tqdm: bool = True, lora_request: Any = None
    ) -> list[str]:
        return self.llm_engine.queue(
            self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        )

    def enqueue_chat(self, messages: list[Any], sampling_params: Any = None, **kwargs: Any) -> list[str]:
        return self.llm_engine.queue(self.chat(messages, sampling_params, **kwargs))

    @property
    def llm_engine(self) -> FakeEngine:
        if not hasattr(self, "_engine"):
            self._engine = FakeEngine(max_model_len=self.kwargs.get("max_model_len"))
        return self._engine

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()


class FakeEngine:
    """vLLM's engine as the feed steps it: a queued request is answered at the next step."""

    def __init__(self, *, max_model_len: int | None) -> None:
        self.model_config = types.SimpleNamespace(max_model_len=max_model_len)
        self.queued: list[Any] = []
        self.added = 0

    def queue(self, outputs: list[Any]) -> list[str]:
        ids = []
        for output in outputs:
            output.request_id, output.finished = str(self.added), True
            self.added += 1
            self.queued.append(output)
            ids.append(f"{output.request_id}-0a1b2c3d")  # the engine's internal id, as vLLM's enqueue returns
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.queued)

    def get_num_unfinished_requests(self) -> int:
        return len(self.queued)

    def step(self) -> list[Any]:
        answered, self.queued = self.queued, []
        return answered

    def abort_request(self, request_ids: list[str]) -> None:
        self.queued = [output for output in self.queued if output.request_id not in request_ids]


class FakeTokenizer:
    """One token a character, plus a start token; a chat renders as its contents joined by newlines."""

    def __len__(self) -> int:
        return 100

    def __call__(
        self, text: str, add_special_tokens: bool = True, truncation: bool = False, max_length: int | None = None
    ) -> dict[str, list[int]]:
        ids = [0] * (len(text) + add_special_tokens)
        return {"input_ids": ids[:max_length] if truncation else ids}

    def apply_chat_template(self, messages: list[Any], *, add_generation_prompt: bool, tokenize: bool) -> str:
        return "\n".join(message["content"] for message in messages) + "\n"


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


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
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = FakeLoRARequest  # type: ignore[attr-defined]
    platforms = types.ModuleType("vllm.platforms")
    # A CUDA build: the stand-in stands for a GPU host's vLLM.
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False, device_type="cuda")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_request)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # xgrammar, which the grammar gate's process compiles with, comes with vLLM: absent here.
    monkeypatch.setattr(grammar_gate, "XGRAMMAR", grammar_compilers.STANDIN)
    FakeLLM.instances.clear()
    yield module
    while LOADED:
        LOADED.pop().unload()  # and with it the grammar gate's process, where a test started one
    FakeLLM.instances.clear()


LOADED: list[VllmEngine] = []
"""Engines `loaded` made, unloaded when `fake_vllm` ends."""


def loaded(spec: ModelSpec) -> tuple[VllmEngine, FakeLLM]:
    engine = VllmEngine(spec)
    engine.load(device="cuda")
    LOADED.append(engine)
    return engine, FakeLLM.instances[-1]


def test_the_registry_builds_this_engine_for_its_name() -> None:
    assert isinstance(create_engine(vllm_spec("/models/x")), VllmEngine)


def test_without_the_vllm_extra_loading_is_a_load_error_that_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError, installed or not

    with pytest.raises(EngineLoadError, match="vLLM is not installed"):
        VllmEngine(vllm_spec(tmp_path)).load(device="cuda")


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_the_cuda_build_refuses_a_device_other_than_the_slots_gpus(
    fake_vllm: types.ModuleType, tmp_path: Path, device: str
) -> None:
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
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    }


def test_prefix_caching_is_on_for_generation_unless_the_catalog_turns_it_off(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    _, embedding = loaded(vllm_spec(tmp_path, task="embed"))
    _, off = loaded(vllm_spec(tmp_path, load_params={"enable_prefix_caching": False}))

    assert "enable_prefix_caching" not in embedding.kwargs
    assert off.kwargs["enable_prefix_caching"] is False


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


# tool_choice auto: vLLM's tool parser for the model's family reads the calls back


def test_without_a_tool_parser_auto_is_refused_naming_tool_choice(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, _ = loaded(vllm_spec(tmp_path, task="chat"))
    tools = [{"type": "function", "function": {"name": "get_time"}}]

    with pytest.raises(ParamError) as refused:
        engine.run_requests([[{"role": "user", "content": "hi"}]], [{"tools": tools}])
    assert refused.value.field == "tool_choice"


def test_a_prompt_without_an_adapter_sends_no_lora_request_and_a_model_without_lora_refuses_one(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path))
    engine.run_batch(["a"], {"max_tokens": 4})
    assert llm.loras == [None]
    with pytest.raises(EngineLoadError, match="does not serve LoRA adapters"):
        engine.run_batch(["a"], {ADAPTER_PARAM: {"name": "x", "version": "1", "source": str(tmp_path), "rank": 4}})
