"""Shortened embeddings are a catalog declaration: only a model with `matryoshka_dimensions` takes `dimensions`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ValidationError

from portal.catalog.models import Model
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.submit import job_submit
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db


def matryoshka_minilm() -> Model:
    """The bundled weights under a catalog entry that declares Matryoshka training (the real one does not)."""
    return ModelFactory(name="minilm-matryoshka", matryoshka_dimensions=[384, 256, 128, 64], is_default=False)


@pytest.mark.parametrize("dimensions", [1, 64, 100, 384])
def test_a_matryoshka_model_takes_any_size_up_to_its_full_one(dimensions: int) -> None:
    assert matryoshka_minilm().dimensions_problem(dimensions) is None


@pytest.mark.parametrize("dimensions", [0, -1, 385, 64.0, "64", True, None])
def test_a_size_that_is_not_a_whole_number_up_to_the_full_one_is_a_problem(dimensions: Any) -> None:
    problem = matryoshka_minilm().dimensions_problem(dimensions)

    assert problem is not None
    assert problem.startswith("must be a whole number from 1 to 384, the embedding size of model 'minilm-matryoshka'")


def test_a_model_without_the_declaration_cannot_shorten_its_embeddings(minilm: Model) -> None:
    assert minilm.dimensions_problem(64) == (
        "is not supported by model 'all-MiniLM-L6-v2': its catalog entry declares no Matryoshka training "
        "(matryoshka_dimensions), so its embeddings cannot be shortened"
    )


@pytest.mark.parametrize("declared", [[384, 0], [384, 384], ["384"], {"384": True}, [True]])
def test_the_declaration_must_be_a_list_of_distinct_positive_sizes(declared: Any) -> None:
    model = ModelFactory.build(gpu_class=ModelFactory().gpu_class, matryoshka_dimensions=declared)

    with pytest.raises(ValidationError, match="matryoshka_dimensions"):
        model.full_clean()


def test_the_native_api_refuses_dimensions_for_a_model_without_the_declaration(
    acme: Any, minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"custom_id": "a", "input": ["one", "two"]}])

    with pytest.raises(SubmissionError) as refused:
        job_submit(
            tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path), params={"dimensions": 64})
        )

    assert refused.value.field == "params"
    assert refused.value.message.startswith("params.dimensions is not supported by model 'all-MiniLM-L6-v2'")


def test_the_native_api_takes_lists_of_texts_and_dimensions_for_a_matryoshka_model(
    acme: Any, write_jsonl: Callable[..., Path]
) -> None:
    model = matryoshka_minilm()
    path = write_jsonl([{"custom_id": "a", "input": ["one", "two"]}, {"custom_id": "b", "input": "three"}])

    job = job_submit(
        tenant=acme, request=JobRequest(model_name=model.name, input_uri=str(path), params={"dimensions": 64})
    )

    assert job.total_records == 2
    assert job.params == {"dimensions": 64}
    with pytest.raises(SubmissionError, match=r"params.dimensions must be a whole number from 1 to 384"):
        job_submit(
            tenant=acme, request=JobRequest(model_name=model.name, input_uri=str(path), params={"dimensions": 512})
        )
