"""`/v1/moderations` batches on a classification model whose labels are OpenAI's moderation categories."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from gpuworkers.engines.classifier import SequenceClassifierEngine
from portal.catalog.models import Model
from portal.openai_api.formats.endpoints import MODERATION_CATEGORIES, MODERATION_THRESHOLD
from tests.api.conftest import Caller
from tests.factories import ModelFactory
from tests.support.openai_batches import batch_lines, openai_client, requests_file, run_batch
from tests.support.tiny_models import build_tiny_classifier

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

MODERATIONS = "/v1/moderations"


def test_a_moderations_batch_answers_each_text_with_the_models_scores_per_category(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], tmp_path: Path
) -> None:
    # A toxicity model's own labels, renamed to OpenAI's categories by its catalog entry.
    model_dir = build_tiny_classifier(tmp_path / "tiny-moderation", ["insult", "hate", "threat"])
    model = ModelFactory(
        name="tiny-moderation",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.CLASSIFY,
        source=str(model_dir),
        load_params={"label_map": {"insult": "harassment", "threat": "violence"}},
        is_default=False,
    )
    client = openai_client(live_server, caller("acme").key)
    texts = ["You are lovely.", "Something rather rude", "A neutral remark about the weather."]
    bodies = [{"model": model.name, "input": text} for text in texts]
    batch = run_batch(
        client, requests_file(tmp_path / "moderations.jsonl", MODERATIONS, bodies), MODERATIONS, pipeline_workers
    )

    assert batch.status == "completed", batch
    lines = {line["custom_id"]: line for line in batch_lines(client, batch.output_file_id)}
    engine = SequenceClassifierEngine(model.to_spec())
    engine.load(device="cpu")
    try:
        expected = engine.run_batch(texts, {})
    finally:
        engine.unload()
    for n, answer in enumerate(expected):
        body = openai.types.ModerationCreateResponse.model_validate(lines[f"req-{n}"]["response"]["body"])
        [result] = body.results
        scores = result.category_scores.model_dump(by_alias=True)
        for name in ("harassment", "hate", "violence"):
            assert scores[name] == pytest.approx(answer["scores"][name], abs=1e-5)
        # Categories the model does not score read false, applied to no input type.
        applied = result.category_applied_input_types.model_dump(by_alias=True)
        assert {name for name in MODERATION_CATEGORIES if applied.get(name)} == {"harassment", "hate", "violence"}
        assert result.flagged == any(answer["scores"][name] >= MODERATION_THRESHOLD for name in answer["scores"])
