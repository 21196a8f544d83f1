"""The transformers engine, with a tiny GPT-2 built on the fly and loaded back from disk.

The tiny model's tokenizer has one token per character, so token counts can be read off the text.
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
from tests.support.tiny_models import build_tiny_causal_lm

PROMPTS = [
    "Hello",
    "A much longer prompt than all of the others here",
    "x",
    "Medium prompt",
    "Another medium one",
]


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
        "usage": {"prompt_tokens": 5, "completion_tokens": k + 1},
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
        ("fine", {"temperature": -1}, "temperature must be 0 or more"),
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


def test_a_task_other_than_generate_is_a_load_error(model_dir: Path) -> None:
    engine = TransformersEngine(tiny_spec(model_dir, task="embed"))

    with pytest.raises(EngineLoadError, match="runs task 'generate', not 'embed'"):
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
