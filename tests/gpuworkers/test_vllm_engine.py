"""The vllm engine's wiring, against a stand-in ``vllm`` module that records how the engine builds and calls
``vllm.LLM`` (the real vLLM runs only on CUDA GPUs: `test_vllm_on_gpu.py`)."""

from __future__ import annotations

import json
import re
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
from gpuworkers.engines.vllm import DEFAULT_GPU_MEMORY_UTILIZATION, VllmEngine
from gpuworkers.spec import AdapterSpec, ModelSpec
from tests.support import grammar_compilers
from tests.support.tiny_models import write_lora_files
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

    @property
    def llm_engine(self) -> Any:
        return types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=self.kwargs.get("max_model_len")))

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()


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
    monkeypatch.setitem(sys.modules, "vllm", module)
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
        "enable_prefix_caching": True,
        "disable_log_stats": False,
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


def test_token_arrays_go_to_vllm_as_tokens_prompts_in_the_same_embed_call(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task="embed", load_params={"max_model_len": 3}))

    responses = engine.run_batch(["a", [5, 6, 7, 8]], {})
    measured = engine.too_long(["ab", [5, 6, 7, 8]], {})

    assert [call[:2] for call in llm.calls] == [("embed", ["a", {"prompt_token_ids": [5, 6, 7, 8]}])]
    assert [response["usage"] for response in responses] == [{"prompt_tokens": 1}, {"prompt_tokens": 4}]
    assert measured[0] is None and measured[1] is not None and measured[1].startswith("the input has 4 tokens")
    with pytest.raises(ValueError, match="token id 100 is outside the model's vocabulary of 100 ids"):
        engine.run_batch([[1, 100]], {})


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


@dataclass
class StandInChatRequest:
    """vLLM's ChatCompletionRequest, the fields the engine and a parser read."""

    model: str
    messages: list[Any]
    tools: list[Any]
    tool_choice: str
    skip_special_tokens: bool = True


class TagToolParser:
    """Reads calls framed as ``<tool_call>{"name", "arguments"}</tool_call>`` and keeps the special tokens
    that frame them, as vLLM's Hermes parser does; answers with the shapes of vLLM's
    ExtractedToolCallInformation."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def adjust_request(self, request: StandInChatRequest) -> StandInChatRequest:
        request.skip_special_tokens = False
        return request

    def extract_tool_calls(self, model_output: str, request: StandInChatRequest) -> Any:
        assert request.tool_choice == "auto" and request.tools
        found = re.findall(r"<tool_call>(.*?)</tool_call>", model_output)
        if not found:
            return types.SimpleNamespace(tools_called=False, tool_calls=[], content=model_output)
        decoded = [json.loads(text) for text in found]
        calls = [
            types.SimpleNamespace(function=types.SimpleNamespace(name=c["name"], arguments=json.dumps(c["arguments"])))
            for c in decoded
        ]
        return types.SimpleNamespace(tools_called=True, tool_calls=calls, content=model_output.split("<tool_call>")[0])


@pytest.fixture
def fake_tool_parsers(fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    parsers = types.ModuleType("vllm.tool_parsers")

    class ToolParserManager:
        tool_parsers = {"tags": TagToolParser}

        @classmethod
        def get_tool_parser(cls, name: str) -> Any:
            return cls.tool_parsers[name]

    parsers.ToolParserManager = ToolParserManager  # type: ignore[attr-defined]
    protocol = types.ModuleType("vllm.entrypoints.openai.chat_completion.protocol")
    protocol.ChatCompletionRequest = StandInChatRequest  # type: ignore[attr-defined]
    for name, module in (
        ("vllm.tool_parsers", parsers),
        ("vllm.entrypoints", types.ModuleType("vllm.entrypoints")),
        ("vllm.entrypoints.openai", types.ModuleType("vllm.entrypoints.openai")),
        ("vllm.entrypoints.openai.chat_completion", types.ModuleType("vllm.entrypoints.openai.chat_completion")),
        ("vllm.entrypoints.openai.chat_completion.protocol", protocol),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    return parsers


def test_auto_tool_choice_replies_freely_and_the_models_tool_parser_reads_the_calls_back(
    fake_tool_parsers: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task="chat", load_params={"tool_call_parser": "tags"}))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    # The fake answers each conversation with its last message: these are the model's replies.
    calling = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    conversations = [[{"role": "user", "content": calling}], [{"role": "user", "content": "It is sunny."}]]

    called, answered = engine.run_requests(conversations, [{"tools": [weather]}, {"tools": [weather]}])

    assert "tool_call_parser" not in llm.kwargs  # the engine's, not an argument of vllm.LLM
    assert called["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert (called["finish_reason"], called["text"]) == ("tool_calls", "Checking.")
    assert answered["text"] == "It is sunny." and "tool_calls" not in answered
    [(kind, _, sampling, tools)] = llm.calls
    assert (kind, tools) == ("chat", [weather])
    # No schema holds the reply, and the special tokens the parser reads stay in the text.
    assert [params.kwargs for params in sampling] == [{"skip_special_tokens": False}] * 2


def test_a_tool_parser_vllm_does_not_have_is_a_load_error_naming_those_it_has(
    fake_tool_parsers: types.ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(EngineLoadError, match=r"'hermes'.*vLLM has tags"):
        VllmEngine(vllm_spec(tmp_path, task="chat", load_params={"tool_call_parser": "hermes"})).load(device="cuda")
    assert FakeLLM.instances == []  # refused before the model took any GPU memory


def test_without_a_tool_parser_auto_is_refused_naming_tool_choice(fake_vllm: types.ModuleType, tmp_path: Path) -> None:
    engine, _ = loaded(vllm_spec(tmp_path, task="chat"))
    tools = [{"type": "function", "function": {"name": "get_time"}}]

    with pytest.raises(ParamError) as refused:
        engine.run_requests([[{"role": "user", "content": "hi"}]], [{"tools": tools}])
    assert refused.value.field == "tool_choice"


def test_truncate_cuts_embedding_inputs_to_their_first_tokens_and_the_rest_are_refused_with_the_hint(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path, task="embed", load_params={"max_model_len": 4}))
    inputs = ["abcdefgh", [5, 6, 7, 8, 9, 10], "ab"]

    cut = engine.run_requests(inputs, [{"truncate": True}] * 2 + [{}])

    [(_, prompts, _)] = llm.calls
    assert prompts == [{"prompt_token_ids": [0] * 4}, {"prompt_token_ids": [5, 6, 7, 8]}, "ab"]
    assert [response["usage"]["prompt_tokens"] for response in cut] == [4, 4, 2]
    too_long = engine.too_long(inputs, {})
    assert too_long[2] is None and all("truncate: true cuts it to fit" in str(message) for message in too_long[:2])


def test_with_lora_enabled_each_prompt_goes_with_its_adapters_request_in_one_call(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    alpha, beta = write_lora_files(tmp_path / "alpha"), write_lora_files(tmp_path / "beta")
    engine, llm = loaded(vllm_spec(tmp_path, load_params={"enable_lora": True}))
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_loras"], llm.kwargs["max_lora_rank"]) == (True, 8, 64)
    adapter = {"name": "alpha", "version": "1", "source": str(alpha), "rank": 8}
    params = [
        {"max_tokens": 4, ADAPTER_PARAM: adapter},
        {"max_tokens": 4},
        {"max_tokens": 4, ADAPTER_PARAM: {**adapter, "name": "beta", "source": str(beta)}},
        {"max_tokens": 4, ADAPTER_PARAM: adapter},
    ]

    engine.run_requests(["a", "b", "c", "d"], params)
    engine.run_requests(["e"], [{"max_tokens": 4, ADAPTER_PARAM: {**adapter, "name": "beta", "source": str(beta)}}])

    assert [call[:2] for call in llm.calls] == [("generate", ["a", "b", "c", "d"]), ("generate", ["e"])]
    # Named by fingerprint: another tenant's "alpha@1" is other files.
    first = FakeLoRARequest(AdapterSpec.from_dict(adapter).fingerprint, 1, str(alpha))
    second = FakeLoRARequest(AdapterSpec.from_dict(params[2][ADAPTER_PARAM]).fingerprint, 2, str(beta))
    assert llm.loras == [[first, None, second, first], [second]]
    # One request an adapter and a process: its source is resolved (an s3:// one listed) once, not a prompt.
    assert llm.loras[0][0] is llm.loras[0][3] and llm.loras[0][2] is llm.loras[1][0]
    assert engine.loaded_adapters() == [first.lora_name, second.lora_name]


def test_a_prompt_without_an_adapter_sends_no_lora_request_and_a_model_without_lora_refuses_one(
    fake_vllm: types.ModuleType, tmp_path: Path
) -> None:
    engine, llm = loaded(vllm_spec(tmp_path))
    engine.run_batch(["a"], {"max_tokens": 4})
    assert llm.loras == [None]
    with pytest.raises(EngineLoadError, match="does not serve LoRA adapters"):
        engine.run_batch(["a"], {ADAPTER_PARAM: {"name": "x", "version": "1", "source": str(tmp_path), "rank": 4}})
