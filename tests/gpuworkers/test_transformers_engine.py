"""The transformers engine, with a tiny GPT-2 built on the fly and loaded back from disk.

The tiny model's tokenizer has one token per character, so token counts can be read off the text, and
a chat template (``user: Hi; assistant:``), for task ``chat``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuworkers.engines import EngineLoadError, create_engine
from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.spec import ModelSpec
from tests.support.tiny_models import TINY_CHAT_TEMPLATE, TINY_EOS, build_tiny_causal_lm

PROMPTS = [
    "Hello",
    "A much longer prompt than all of the others here",
    "x",
    "Medium prompt",
    "Another medium one",
]


CHATS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Answer in one long sentence"},
        {"role": "user", "content": "What is a much longer question?"},
    ],
    [{"role": "user", "content": "x"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}, {"role": "user", "content": "So?"}],
]
RENDERED_CHATS = [
    "user: Hello; assistant:",
    "system: Answer in one long sentence; user: What is a much longer question?; assistant:",
    "user: x; assistant:",
    "user: Hi; assistant: Hey; user: So?; assistant:",
]
"""`CHATS` as the tiny chat template renders them, with the assistant's generation prompt."""


def tiny_spec(directory: Path, **changes: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": "tiny-gpt2",
        "version": "1",
        "engine": "transformers",
        "task": "generate",
        "source": str(directory),
    }
    return ModelSpec(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(tiny_spec(model_dir))
    engine.load(device="cpu")
    yield engine
    engine.unload()


@pytest.fixture(scope="module")
def chat_engine(model_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(tiny_spec(model_dir, task="chat"))
    engine.load(device="cpu")
    yield engine
    engine.unload()


def test_the_registry_builds_this_engine_for_its_name(model_dir: Path) -> None:
    assert isinstance(create_engine(tiny_spec(model_dir)), TransformersEngine)


def test_each_prompt_gets_one_completion(engine: TransformersEngine) -> None:
    responses = engine.run_batch(PROMPTS, {"max_tokens": 5})

    assert len(responses) == len(PROMPTS)
    for response in responses:
        assert isinstance(response["text"], str) and response["text"]
        assert response["finish_reason"] in ("stop", "length")


def test_batched_greedy_completions_equal_one_at_a_time_in_input_order(engine: TransformersEngine) -> None:
    alone = [engine.run_batch([prompt], {"max_tokens": 12})[0] for prompt in PROMPTS]

    batched = engine.run_batch(PROMPTS, {"max_tokens": 12})
    in_pairs = engine.run_batch(PROMPTS, {"max_tokens": 12, "batch_size": 2})

    assert batched == alone
    assert in_pairs == alone
    assert len({response["text"] for response in alone}) > 1  # the check would be empty otherwise


def test_usage_counts_prompt_tokens_and_generated_tokens(engine: TransformersEngine) -> None:
    responses = engine.run_batch(PROMPTS, {"max_tokens": 7})

    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert response["usage"]["prompt_tokens"] == len(prompt)
        if response["finish_reason"] == "length":
            assert response["usage"]["completion_tokens"] == 7 == len(response["text"])


def test_a_stop_string_cuts_the_text_before_it(engine: TransformersEngine) -> None:
    (full,) = engine.run_batch(["Hello"], {"max_tokens": 12})
    stop = full["text"][3:5]
    cut = full["text"].find(stop)

    (stopped,) = engine.run_batch(["Hello"], {"max_tokens": 12, "stop": ["never there", stop]})

    assert stopped["text"] == full["text"][:cut]
    assert stopped["finish_reason"] == "stop"
    assert stopped["stop_sequence"] == stop
    assert stopped["usage"]["completion_tokens"] == cut + len(stop)


def test_a_stop_string_ends_only_the_rows_that_contain_it(engine: TransformersEngine) -> None:
    full = engine.run_batch(PROMPTS, {"max_tokens": 12})
    stop = full[0]["text"][3:5]

    stopped = engine.run_batch(PROMPTS, {"max_tokens": 12, "stop": stop})

    for before, after in zip(full, stopped, strict=True):
        if stop in before["text"]:
            assert after["text"] == before["text"][: before["text"].find(stop)]
        else:
            assert after == before


def test_generation_ends_at_the_end_of_sequence_token_and_counts_it(engine: TransformersEngine, tmp_path: Path) -> None:
    (full,) = engine.run_batch(["Hello"], {"max_tokens": 12})
    # Make a character the model generates, first at position k > 0, its end-of-sequence token.
    k = next(i for i, char in enumerate(full["text"]) if i > 0 and char not in full["text"][:i])
    eos_dir = shutil.copytree(engine.spec.source, tmp_path / "eos")
    generation_config = json.loads((eos_dir / "generation_config.json").read_text())
    generation_config["eos_token_id"] = engine._tokenizer.convert_tokens_to_ids(full["text"][k])  # type: ignore[union-attr]
    (eos_dir / "generation_config.json").write_text(json.dumps(generation_config))
    eos_engine = TransformersEngine(tiny_spec(eos_dir))
    eos_engine.load(device="cpu")

    (response,) = eos_engine.run_batch(["Hello"], {"max_tokens": 12})

    assert response == {
        "text": full["text"][:k],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "completion_tokens": k + 1, "prompt_tokens_details": {"cached_tokens": 0}},
    }


def test_sampling_with_a_seed_is_repeatable(engine: TransformersEngine) -> None:
    params = {"max_tokens": 12, "temperature": 1.5, "top_p": 0.95, "seed": 7}

    first = engine.run_batch(PROMPTS, params)
    second = engine.run_batch(PROMPTS, params)
    greedy = engine.run_batch(PROMPTS, {"max_tokens": 12})

    assert first == second
    assert first != greedy


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        (42, {}, "the prompt must be a string, not int"),
        ("", {}, "the prompt is empty"),
        ("x" * 120, {"max_tokens": 16}, "the prompt has 120 tokens; with max_tokens=16 it exceeds"),
        ("fine", {"max_tokens": 0}, "max_tokens must be a positive integer"),
        ("fine", {"temperature": -1}, "temperature must be in \\[0, 2\\]"),
        ("fine", {"stop": [""]}, "stop must be a non-empty string"),
        ("fine", {"stop": 5}, "stop must be a non-empty string"),
    ],
)
def test_a_bad_prompt_or_parameter_raises_a_value_error(
    engine: TransformersEngine, prompt: object, params: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.run_batch(["fine", prompt], params)


def test_an_empty_batch_gives_no_responses(engine: TransformersEngine) -> None:
    assert engine.run_batch([], {}) == []


def test_a_task_other_than_generate_or_chat_is_a_load_error(model_dir: Path) -> None:
    engine = TransformersEngine(tiny_spec(model_dir, task="embed"))

    with pytest.raises(EngineLoadError, match="runs tasks generate, chat, not 'embed'"):
        engine.load(device="cpu")


def test_a_directory_without_a_model_is_a_load_error(tmp_path: Path) -> None:
    engine = TransformersEngine(tiny_spec(tmp_path))

    with pytest.raises(EngineLoadError, match="cannot load 'tiny-gpt2'"):
        engine.load(device="cpu")


def test_memory_bytes_reports_the_weights_and_unload_frees_them(model_dir: Path) -> None:
    engine = TransformersEngine(tiny_spec(model_dir))
    engine.load(device="cpu")

    loaded_bytes = engine.memory_bytes()
    engine.unload()

    assert 100_000 < loaded_bytes < 200_000  # about 30,000 float32 parameters and GPT-2's mask buffers
    assert engine.memory_bytes() == 0


# Task chat


def test_each_chat_gets_one_completion_shaped_like_a_generated_one(chat_engine: TransformersEngine) -> None:
    responses = chat_engine.run_batch(CHATS, {"max_tokens": 5})

    assert len(responses) == len(CHATS)
    for response in responses:
        assert set(response) == {"text", "finish_reason", "usage"}
        assert isinstance(response["text"], str) and response["text"]
        assert response["finish_reason"] in ("stop", "length")
        assert set(response["usage"]) == {"prompt_tokens", "completion_tokens", "prompt_tokens_details"}


def test_chat_prompt_tokens_are_the_tokens_of_the_rendered_template(chat_engine: TransformersEngine) -> None:
    tokenizer = chat_engine._tokenizer
    assert tokenizer is not None
    rendered = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]

    responses = chat_engine.run_batch(CHATS, {"max_tokens": 7})

    assert rendered == RENDERED_CHATS
    for text, response in zip(rendered, responses, strict=True):
        assert response["usage"]["prompt_tokens"] == len(tokenizer(text)["input_ids"]) == len(text)
        if response["finish_reason"] == "length":
            assert response["usage"]["completion_tokens"] == 7 == len(response["text"])


@pytest.mark.parametrize("params", [{"max_tokens": 12}, {"max_tokens": 12, "batch_size": 2}])
def test_greedy_chat_equals_generate_on_the_rendered_prompts_in_input_order(
    engine: TransformersEngine, chat_engine: TransformersEngine, params: dict[str, object]
) -> None:
    generated = engine.run_batch(RENDERED_CHATS, params)

    chatted = chat_engine.run_batch(CHATS, params)

    assert chatted == generated
    assert len({response["text"] for response in generated}) > 1  # a wrong order would go unseen otherwise


def test_a_stop_string_cuts_a_chat_completion(chat_engine: TransformersEngine) -> None:
    (full,) = chat_engine.run_batch(CHATS[:1], {"max_tokens": 12})
    stop = full["text"][3:5]
    cut = full["text"].find(stop)

    (stopped,) = chat_engine.run_batch(CHATS[:1], {"max_tokens": 12, "stop": stop})

    assert stopped["text"] == full["text"][:cut]
    assert stopped["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == cut + len(stop)


def test_a_chat_template_that_writes_the_bos_token_gets_it_once(model_dir: Path, tmp_path: Path) -> None:
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    # A tokenizer that adds a BOS token to any text it encodes, and a template that writes one too.
    bos_dir = shutil.copytree(model_dir, tmp_path / "bos")
    tokenizer = AutoTokenizer.from_pretrained(bos_dir)
    tokenizer.bos_token = TINY_EOS
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{TINY_EOS} $A", special_tokens=[(TINY_EOS, tokenizer.eos_token_id)]
    )
    tokenizer.chat_template = "{{ bos_token }}" + TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(bos_dir)
    bos_engine = TransformersEngine(tiny_spec(bos_dir, task="chat"))
    bos_engine.load(device="cpu")

    (response,) = bos_engine.run_batch(CHATS[:1], {"max_tokens": 3})

    assert response["usage"]["prompt_tokens"] == 1 + len(RENDERED_CHATS[0])


@pytest.mark.parametrize(
    ("chat", "message"),
    [
        ("Hello", "messages must be a non-empty list of messages, not str"),
        ([], "messages must be a non-empty list of messages, not list"),
        (["Hello"], "each message must be an object with a string 'role'"),
        ([{"content": "no role"}], "each message must be an object with a string 'role'"),
        ([{"role": "user"}], "each message's 'content' must be a string, not NoneType"),
        ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "'content' must be a string, not list"),
    ],
)
def test_a_bad_chat_raises_a_value_error(chat_engine: TransformersEngine, chat: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chat_engine.run_batch([CHATS[0], chat], {})


def test_a_tokenizer_without_a_chat_template_is_a_load_error_for_chat_only(model_dir: Path, tmp_path: Path) -> None:
    # save_pretrained keeps the template in a file of its own.
    plain_dir = shutil.copytree(model_dir, tmp_path / "plain", ignore=shutil.ignore_patterns("chat_template.jinja"))
    for_chat = TransformersEngine(tiny_spec(plain_dir, task="chat"))
    for_generate = TransformersEngine(tiny_spec(plain_dir))

    with pytest.raises(EngineLoadError, match="the tokenizer of 'tiny-gpt2' has no chat template"):
        for_chat.load(device="cpu")
    for_generate.load(device="cpu")
    assert for_generate.run_batch(["Hello"], {"max_tokens": 2})[0]["usage"]["prompt_tokens"] == 5


def test_a_prompt_that_overflows_the_context_is_too_long_unless_truncated_to_its_last_tokens(
    engine: TransformersEngine,
) -> None:
    # The tiny model's context is 128 tokens of one character each.
    long_prompt, fitting = "a" * 100 + "The end of a long prompt", "Short"

    assert engine.too_long([long_prompt, fitting], {"max_tokens": 10}) == [
        "the prompt has 124 tokens; with max_tokens=10 it exceeds the model's context of 128 tokens "
        "(truncate: true keeps the prompt's last tokens instead)",
        None,
    ]
    [truncated] = engine.run_batch([long_prompt], {"max_tokens": 10, "truncate": True})
    [its_end] = engine.run_batch([long_prompt[-118:]], {"max_tokens": 10})
    assert truncated == its_end
    assert truncated["usage"]["prompt_tokens"] == 118
