"""Task ``classify`` on the transformers engine: a tiny multi-label BERT saved by the test and loaded back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuworkers.batching import INPUT_TOO_LONG, run_records
from gpuworkers.engines.base import EngineLoadError, create_engine
from gpuworkers.engines.classifier import SequenceClassifierEngine
from gpuworkers.spec import ModelSpec
from tests.support.tiny_models import build_tiny_classifier

LABELS = ["toxic", "hate", "violence"]


def classifier_spec(directory: Path, **load_params: object) -> ModelSpec:
    return ModelSpec(
        name="tiny-classifier",
        version="1",
        engine="transformers",
        task="classify",
        source=str(directory),
        load_params=dict(load_params),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-classifier"), LABELS, max_positions=32)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[SequenceClassifierEngine]:
    engine = SequenceClassifierEngine(classifier_spec(model_dir, label_map={"toxic": "harassment"}))
    engine.load(device="cpu")
    yield engine
    engine.unload()


def test_the_transformers_engine_classifies_with_this_engine(model_dir: Path) -> None:
    assert isinstance(create_engine(classifier_spec(model_dir)), SequenceClassifierEngine)


def test_each_text_gets_a_score_per_label_equal_to_the_model_run_directly(
    engine: SequenceClassifierEngine, model_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["a calm sentence", "another, longer sentence here"]
    responses = engine.run_batch(texts, {"batch_size": 1})

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for text, response in zip(texts, responses, strict=True):
        with torch.inference_mode():
            expected = torch.sigmoid(model(**tokenizer(text, return_tensors="pt")).logits)[0].tolist()
        assert list(response["scores"]) == ["harassment", "hate", "violence"]
        assert list(response["scores"].values()) == pytest.approx(expected, abs=1e-5)
        assert response["label"] == max(response["scores"], key=response["scores"].__getitem__)
        assert response["usage"] == {"prompt_tokens": len(text)}


def test_a_batch_scores_as_its_texts_alone(engine: SequenceClassifierEngine) -> None:
    texts = ["short", "a much longer text that pads the others"]

    together = engine.run_batch(texts, {})
    alone = [engine.run_batch([text], {})[0] for text in texts]

    for batched, single in zip(together, alone, strict=True):
        assert list(batched["scores"].values()) == pytest.approx(list(single["scores"].values()), abs=1e-5)


def test_a_text_over_the_models_positions_is_refused_unless_truncated(engine: SequenceClassifierEngine) -> None:
    items = [("long", "x" * 40), ("cut", "x" * 40)]

    (refused,) = run_records(engine, items[:1], params={}, micro_batch_size=4)
    (cut,) = run_records(engine, items[1:], params={"truncate": True}, micro_batch_size=4)

    assert refused.error is not None and refused.error["code"] == INPUT_TOO_LONG
    assert "40 tokens; the model takes at most 32" in refused.error["message"]
    assert cut.response is not None and cut.response["usage"]["prompt_tokens"] == 32


def test_a_label_map_that_merges_two_labels_is_a_load_error(model_dir: Path) -> None:
    engine = SequenceClassifierEngine(classifier_spec(model_dir, label_map={"toxic": "hate"}))

    with pytest.raises(EngineLoadError, match="the same name"):
        engine.load(device="cpu")


def test_a_classifier_whose_tokenizer_has_no_pad_token_pads_with_its_end_token(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    from tests.support.tiny_models import build_tiny_causal_lm

    directory = build_tiny_causal_lm(tmp_path / "gpt2-classifier")
    config = GPT2Config.from_pretrained(
        directory, id2label={0: "hate", 1: "violence"}, label2id={"hate": 0, "violence": 1}
    )
    GPT2ForSequenceClassification(config).save_pretrained(directory)
    assert AutoTokenizer.from_pretrained(directory).pad_token is None
    engine = SequenceClassifierEngine(classifier_spec(directory))
    engine.load(device="cpu")
    try:
        together = engine.run_batch(["short", "a longer text than that"], {})
        alone = [engine.run_batch([text], {})[0] for text in ("short", "a longer text than that")]
    finally:
        engine.unload()

    for batched, single in zip(together, alone, strict=True):
        assert list(batched["scores"].values()) == pytest.approx(list(single["scores"].values()), abs=1e-5)
