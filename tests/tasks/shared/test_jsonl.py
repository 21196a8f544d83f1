from __future__ import annotations

import io
import json

import pytest

from tasks.shared.formats.jsonl import JsonlCheck, check_jsonl, iter_jsonl


def _stream(lines: list[str]) -> io.BytesIO:
    return io.BytesIO(("\n".join(lines) + "\n").encode())


def test_valid_records_keep_their_ids_and_missing_ids_become_line_numbers() -> None:
    check = JsonlCheck()
    lines = [json.dumps({"custom_id": "a", "input": "x"}), "", json.dumps({"input": "y"})]
    records = list(iter_jsonl(_stream(lines), input_field="input", check=check))
    assert [(r.line, r.custom_id) for r in records] == [(1, "a"), (3, "3")]
    assert records[1].data == {"custom_id": "3", "input": "y"}
    assert check.ok


def test_every_kind_of_bad_line_is_named_with_its_line_number() -> None:
    lines = [
        json.dumps({"custom_id": "a", "input": "fine"}),
        "{not json",
        "[1, 2]",
        json.dumps({"custom_id": "b"}),
        json.dumps({"custom_id": "a", "input": "again"}),
        json.dumps({"custom_id": 7, "input": "numeric id"}),
    ]
    data = _stream(lines).getvalue()
    check = check_jsonl(lambda: io.BytesIO(data), input_field="input")
    messages = [str(problem) for problem in check.problems]
    assert messages[0].startswith("line 2: not valid JSON")
    assert messages[1] == "line 3: expected a JSON object, got list"
    assert messages[2] == "line 4: missing field 'input'"
    assert messages[3] == "line 5: duplicate custom_id 'a' (first on line 1)"
    assert messages[4] == "line 6: custom_id must be a non-empty string"
    assert check.problem_count == 5
    assert not check.ok


def test_the_summary_caps_the_problems_it_lists_and_counts_the_rest() -> None:
    data = _stream(["oops"] * 30).getvalue()
    check = check_jsonl(lambda: io.BytesIO(data), input_field="input", max_problems=5)
    summary = check.summary(limit=3)
    assert summary.startswith("30 bad lines: line 1: not valid JSON")
    assert summary.endswith("and 27 more bad lines")


def test_an_input_without_records_has_no_problems() -> None:
    check = check_jsonl(lambda: io.BytesIO(b"\n\n"), input_field="input")
    assert check.ok
    assert check.records == 0


def test_a_line_longer_than_the_limit_is_refused_without_being_held_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tasks.shared.formats.jsonl.MAX_LINE_BYTES", 64)
    long_line = json.dumps({"custom_id": "big", "input": "x" * 500})
    data = _stream([json.dumps({"input": "short"}), long_line, json.dumps({"input": "after"})]).getvalue()
    check = check_jsonl(lambda: io.BytesIO(data), input_field="input")
    assert [str(problem) for problem in check.problems] == ["line 2: line is longer than 64 bytes"]
    assert check.records == 2


def test_many_records_with_unique_ids_need_no_second_pass() -> None:
    data = _stream([json.dumps({"custom_id": f"id-{n}", "input": "x"}) for n in range(5000)]).getvalue()
    opened = []

    def reopen() -> io.BytesIO:
        opened.append(1)
        return io.BytesIO(data)

    check = check_jsonl(reopen, input_field="input")
    assert check.ok
    assert check.records == 5000
    assert len(opened) == 1


@pytest.mark.parametrize(
    ("input_field", "value", "expected"),
    [
        ("input", {"x": 1}, "input must be a string, not an object"),
        ("input", [], "input must be a string or a non-empty array of strings, not an empty array"),
        ("input", ["a", 7.5], "input must hold strings; item 2 is a number"),
        ("input", [101, -3], "input is a token array whose token 1 is negative (-3)"),
        ("input", [[101], []], "input must hold token arrays alike; item 2 is an empty array"),
        ("input", [[101], "a"], "input must hold token arrays alike; item 2 is a string"),
        (
            "input",
            [[101], [1, "a"]],
            "input must hold token arrays alike; item 2 is an array of something else than token ids",
        ),
        ("input", [[101], [2, -1]], "input must hold token arrays; the token 1 is negative (-1), in item 2"),
        ("input", [[101]] * 2049, "input holds 2049 texts, over the limit of 2048 a record"),
        ("input", ["a"] * 2049, "input holds 2049 texts, over the limit of 2048 a record"),
        ("input", 7, "input must be a string, not a number"),
        ("input", None, "input must be a string, not null"),
        ("prompt", True, "prompt must be a string, not a boolean"),
        ("messages", "hello", "messages must be a non-empty array of message objects, not a string"),
        ("messages", [], "messages must be a non-empty array of message objects, not an empty array"),
        (
            "messages",
            [{"role": "user", "content": "hi"}, "bye"],
            "messages must hold message objects; message 2 is a string",
        ),
    ],
)
def test_an_input_of_the_wrong_type_for_its_task_is_named_with_its_line(
    input_field: str, value: object, expected: str
) -> None:
    good = {"custom_id": "ok", input_field: "fine" if input_field != "messages" else [{"role": "user", "content": "x"}]}
    lines = [json.dumps(good), json.dumps({"custom_id": "bad", input_field: value})]
    check = check_jsonl(lambda: _stream(lines), input_field=input_field)
    assert [str(problem) for problem in check.problems] == [f"line 2: {expected}"]
    assert check.records == 1


def test_token_arrays_of_the_models_ids_are_inputs_of_an_embedding_model() -> None:
    values = [[101, 7592, 102], [[101, 102], [101, 2088, 102]], [0]]
    lines = [json.dumps({"custom_id": f"t{n}", "input": value}) for n, value in enumerate(values)]

    check = check_jsonl(lambda: _stream(lines), input_field="input")

    assert check.ok and check.records == 3


def test_an_openai_request_body_with_the_wrong_input_type_is_named_too() -> None:
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": {"x": 1}}}
    check = check_jsonl(lambda: _stream([json.dumps(line)]), input_field="input")
    assert [str(problem) for problem in check.problems] == ["line 1: input must be a string, not an object"]


def test_a_record_keeps_its_own_params_and_bad_ones_are_named_with_their_line() -> None:
    lines = [
        json.dumps({"custom_id": "a", "input": "x", "params": {"temperature": 0.2, "seed": 7}}),
        json.dumps({"custom_id": "b", "input": "y", "params": [0.2]}),
        json.dumps({"custom_id": "c", "input": "z", "params": {"micro_batch_size": 4}}),
    ]
    check = JsonlCheck()
    records = list(iter_jsonl(_stream(lines), input_field="input", check=check))
    assert [record.data for record in records] == [
        {"custom_id": "a", "input": "x", "params": {"temperature": 0.2, "seed": 7}}
    ]
    assert [str(problem) for problem in check.problems] == [
        "line 2: params must be a JSON object, got list",
        "line 3: params.micro_batch_size applies to the whole job and cannot be set on one record",
    ]


def test_a_refused_record_is_kept_as_its_id_and_refusal_alone_and_a_refusal_must_be_text() -> None:
    lines = [
        json.dumps({"custom_id": "a", "refused": "params.max_tokens: must be at least 1", "params": {"top_k": 2}}),
        json.dumps({"custom_id": "b", "refused": ""}),
        json.dumps({"custom_id": "c", "messages": [{"role": "user", "content": "Hi"}], "refused": {"why": 1}}),
    ]
    check = JsonlCheck()
    records = list(iter_jsonl(_stream(lines), input_field="messages", check=check))
    assert [record.data for record in records] == [
        {"custom_id": "a", "refused": "params.max_tokens: must be at least 1"}
    ]
    assert records[0].refused
    assert [str(problem) for problem in check.problems] == [
        "line 2: refused must be a non-empty string: why the record cannot run",
        "line 3: refused must be a non-empty string: why the record cannot run",
    ]
