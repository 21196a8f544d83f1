"""What one line's input may hold (lists of texts, token arrays) and `dimensions`, through
`portal.openai_api.formats.input_file`; no database."""

from __future__ import annotations

from typing import Any

import pytest

from tests.portal.openai_api.input_file_lines import COMPLETIONS, EMBEDDINGS, INPUTS, convert, jsonl, request


def test_the_embedding_of_several_texts_is_one_record_keeping_them_in_order() -> None:
    result, records = convert(jsonl(request("many", input=["one", "two", "three"]), request("one")))

    assert result.ok
    assert records == [
        {"custom_id": "many", "input": ["one", "two", "three"]},
        {"custom_id": "one", "input": INPUTS[EMBEDDINGS][1]},
    ]


def test_token_arrays_are_inputs_and_a_list_of_one_array_is_unwrapped_to_it_but_one_array_of_one_id_is_not() -> None:
    inputs = [[101, 7592, 102], [[101, 102], [101, 2088, 102]], [[101, 102]], [7]]
    lines = [request(f"t{n}", input=value) for n, value in enumerate(inputs)]

    result, records = convert(jsonl(*lines))

    assert result.ok, result.problems
    assert [record["input"] for record in records] == [
        [101, 7592, 102],
        [[101, 102], [101, 2088, 102]],
        [101, 102],
        [7],
    ]


def test_a_completion_of_several_prompts_is_refused_with_how_to_split_them() -> None:
    line = request(url=COMPLETIONS)
    line["body"]["prompt"] = ["one", "two", "three"]

    result, _ = convert(jsonl(line), endpoint=COMPLETIONS)

    [problem] = result.problems
    assert problem.message == (
        "body.prompt holds 3 prompts, but Batchery runs one prompt a request: "
        "give each prompt its own line and custom_id"
    )


def matryoshka(model: str, dimensions: Any) -> str | None:
    """The catalog of these tests: model "m" declares Matryoshka training up to 384 values; "plain" does not."""
    if model == "plain":
        return "is not supported by model 'plain'"
    return (
        None if isinstance(dimensions, int) and 1 <= dimensions <= 384 else f"must be from 1 to 384, not {dimensions}"
    )


def test_dimensions_a_model_supports_become_a_param_of_the_job() -> None:
    result, records = convert(
        jsonl(request("a", dimensions=128), request("b", dimensions=128)), dimensions_problem=matryoshka
    )

    assert result.ok
    assert result.params == {"dimensions": 128}
    assert [record["custom_id"] for record in records] == ["a", "b"]


def test_dimensions_are_refused_on_another_endpoint_than_embeddings() -> None:
    result, _ = convert(
        jsonl(request(url=COMPLETIONS, dimensions=64)), endpoint=COMPLETIONS, dimensions_problem=matryoshka
    )

    [problem] = result.problems
    assert (problem.param, problem.message) == (
        "body.dimensions",
        "body.dimensions is a parameter of /v1/embeddings, not of /v1/completions",
    )


@pytest.mark.parametrize(
    ("model", "dimensions", "message"),
    [
        ("plain", 64, "body.dimensions is not supported by model 'plain'"),
        ("m", 385, "body.dimensions must be from 1 to 384, not 385"),
        ("m", 0, "body.dimensions must be from 1 to 384, not 0"),
        ("m", "64", "body.dimensions must be from 1 to 384, not 64"),
    ],
)
def test_dimensions_the_model_cannot_give_are_refused_on_every_line_naming_the_field(
    model: str, dimensions: Any, message: str
) -> None:
    lines = jsonl(request("a", model=model, dimensions=dimensions), request("b", model=model, dimensions=dimensions))

    result, records = convert(lines, dimensions_problem=matryoshka)

    assert records == []
    assert [(problem.line, problem.code, problem.param, problem.message) for problem in result.problems] == [
        (1, "invalid_param", "body.dimensions", message),
        (2, "invalid_param", "body.dimensions", message),
    ]
