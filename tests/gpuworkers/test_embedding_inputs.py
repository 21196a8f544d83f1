"""Records of several texts and shortened embeddings (`EmbeddingInputs`), over the bundled all-MiniLM-L6-v2."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from gpuworkers.batching import run_records
from gpuworkers.engines.embeddings import EmbeddingInputs, shortened
from gpuworkers.engines.sentence_transformers import SentenceTransformersEngine
from tests.gpuworkers.test_sentence_transformers_engine import MINILM, SENTENCES


class CountingEngine:
    """The real engine, counting its calls and the texts of each."""

    def __init__(self, engine: SentenceTransformersEngine) -> None:
        self.engine = engine
        self.calls: list[int] = []

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.calls.append(len(inputs))
        return self.engine.run_batch(inputs, params)


@pytest.fixture(scope="module")
def minilm() -> Iterator[SentenceTransformersEngine]:
    engine = SentenceTransformersEngine(MINILM)
    engine.load(device="cpu")
    yield engine
    engine.unload()


@pytest.fixture
def counting(minilm: SentenceTransformersEngine) -> CountingEngine:
    return CountingEngine(minilm)


def alone(minilm: SentenceTransformersEngine, text: str) -> np.ndarray:
    (response,) = minilm.run_batch([text], {})
    return np.asarray(response["embedding"])


def test_a_token_array_is_one_input_and_a_list_of_them_one_input_each(
    minilm: SentenceTransformersEngine, counting: CountingEngine
) -> None:
    assert minilm._model is not None
    ids = [minilm._model.tokenizer(text)["input_ids"] for text in SENTENCES[:3]]
    records = [ids[0], ids[1:3], [ids[2]]]

    single, listed, one_listed = EmbeddingInputs(counting).run_batch(records, {})  # type: ignore[arg-type]

    assert counting.calls == [4]
    np.testing.assert_allclose(single["embedding"], alone(minilm, SENTENCES[0]), atol=1e-5)
    assert single["usage"] == {"prompt_tokens": len(ids[0])}
    assert len(listed["embeddings"]) == 2 and listed["usage"] == {"prompt_tokens": len(ids[1]) + len(ids[2])}
    for text, embedding in zip(SENTENCES[1:3], listed["embeddings"], strict=True):
        np.testing.assert_allclose(embedding, alone(minilm, text), atol=1e-5)
    np.testing.assert_allclose(one_listed["embeddings"][0], alone(minilm, SENTENCES[2]), atol=1e-5)


def test_a_micro_batch_embeds_every_text_of_every_record_in_one_call(
    minilm: SentenceTransformersEngine, counting: CountingEngine
) -> None:
    records = [SENTENCES[0], SENTENCES[1:4], ["hello world"]]

    single, listed, one_listed = EmbeddingInputs(counting).run_batch(records, {})  # type: ignore[arg-type]

    assert counting.calls == [5]
    assert single.keys() == {"embedding", "usage"}
    assert [len(embedding) for embedding in listed["embeddings"]] == [384, 384, 384]
    for text, embedding in zip(SENTENCES[1:4], listed["embeddings"], strict=True):
        np.testing.assert_allclose(embedding, alone(minilm, text), atol=1e-5)
    tokens = [minilm.run_batch([text], {})[0]["usage"]["prompt_tokens"] for text in SENTENCES[1:4]]
    assert listed["usage"] == {"prompt_tokens": sum(tokens)}
    assert len(one_listed["embeddings"]) == 1


def test_a_record_of_one_text_gets_exactly_the_engines_response(minilm: SentenceTransformersEngine) -> None:
    (wrapped,) = EmbeddingInputs(minilm).run_batch(["hello world"], {})
    (direct,) = minilm.run_batch(["hello world"], {})

    assert wrapped.keys() == direct.keys() and wrapped["usage"] == direct["usage"]
    assert np.array_equal(wrapped["embedding"], direct["embedding"])


def test_dimensions_keep_the_normalized_prefix_of_the_full_embedding(minilm: SentenceTransformersEngine) -> None:
    single, listed = EmbeddingInputs(minilm).run_batch([SENTENCES[0], SENTENCES[1:3]], {"dimensions": 64})

    embeddings = [single["embedding"], *listed["embeddings"]]
    for text, embedding in zip(SENTENCES[:3], embeddings, strict=True):
        prefix = alone(minilm, text)[:64]
        assert embedding.shape == (64,) and embedding.dtype == np.float32
        assert np.linalg.norm(embedding) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(embedding, prefix / np.linalg.norm(prefix), atol=1e-5)


def test_dimensions_larger_than_the_embedding_fail_the_record() -> None:
    with pytest.raises(ValueError, match="dimensions is 385, but the model's embeddings have 384 values"):
        shortened(np.ones(384, dtype=np.float32), 385)


@pytest.mark.parametrize("dimensions", [0, -3, 2.5, "64", True])
def test_dimensions_that_are_not_a_positive_whole_number_fail(
    minilm: SentenceTransformersEngine, dimensions: Any
) -> None:
    with pytest.raises(ValueError, match="dimensions must be a positive whole number"):
        EmbeddingInputs(minilm).run_batch(["hello"], {"dimensions": dimensions})


def test_a_bad_text_in_a_list_fails_its_record_alone(minilm: SentenceTransformersEngine) -> None:
    items = [("a", "first"), ("b", ["fine", ""]), ("c", ["third", "fourth"])]

    results = list(run_records(EmbeddingInputs(minilm), items, params={}, micro_batch_size=3))

    assert [result.custom_id for result in results] == ["a", "b", "c"]
    assert results[1].error == {"code": "engine_error", "message": "ValueError: the input is an empty string"}
    assert results[0].response is not None and results[2].response is not None
    assert len(results[2].response["embeddings"]) == 2


def test_a_record_of_texts_is_too_long_when_one_of_them_is_naming_which(minilm: SentenceTransformersEngine) -> None:
    long_text = "word " * 300
    records = [["fine", long_text], long_text, ["fine", "also fine"]]

    wrapped = EmbeddingInputs(minilm)
    messages = wrapped.too_long(records, {})

    assert messages[0] is not None and messages[0].startswith("input 1 of the list: the input has 302 tokens")
    assert messages[1] is not None and messages[1].startswith("the input has 302 tokens")
    assert messages[2] is None
    results = list(run_records(wrapped, [("a", records[0]), ("b", records[2])], params={}, micro_batch_size=4))
    assert results[0].error is not None and results[0].error["code"] == "input_too_long"
    assert results[1].response is not None and len(results[1].response["embeddings"]) == 2
