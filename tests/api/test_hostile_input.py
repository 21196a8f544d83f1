"""POST /api/v1/jobs/ as an attacker probes it: every hostile request is a 400 naming what is wrong, never a 500."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from portal.catalog.models import Model
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.request_checks import MAX_PARAMS_BYTES, MAX_PARAMS_DEPTH, MAX_SHARD_SIZE
from portal.jobs.services.submit import job_submit
from tests.api.conftest import Caller
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db

RECORDS = [{"custom_id": f"r{n}", "input": f"sentence {n}"} for n in range(3)]


def _nested(depth: int) -> str:
    """A JSON object `depth` levels deep, counting itself: {"a": {"a": ... {}}}."""
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def _post_json(alice: Caller, body: str, tmp_path: Path) -> Any:
    with override_settings(BATCHERY_INPUT_ROOTS=[tmp_path.as_uri()]):
        return alice.client.post("/api/v1/jobs/", data=body, content_type="application/json")


def _upload(alice: Caller, path: Path, **fields: Any) -> Any:
    with path.open("rb") as handle:
        return alice.client.post("/api/v1/jobs/", {"file": handle, **fields}, format="multipart")


def _assert_refused(response: Any, field: str) -> dict[str, Any]:
    assert response.status_code == 400, response.content[:500]
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert field in error["fields"]
    return error


# params


def test_params_nested_20000_levels_deep_in_a_json_body_is_a_400_naming_params(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    uri = write_jsonl(RECORDS).as_uri()
    body = f'{{"model": "{minilm.name}", "input_uri": "{uri}", "params": {_nested(20_000)}}}'
    error = _assert_refused(_post_json(alice, body, tmp_path), "params")
    assert error["message"] == "JSON parse error - params is nested too deeply to read"
    assert not Job.objects.exists()


def test_a_json_body_that_is_itself_20000_levels_deep_is_a_400(caller: Callable[..., Caller], tmp_path: Path) -> None:
    alice = caller("acme")
    response = _post_json(alice, "[" * 20_000 + "]" * 20_000, tmp_path)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "JSON parse error - the request body is nested too deeply to read"


def test_params_nested_20000_levels_deep_in_a_form_field_is_a_400_naming_params(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(alice, write_jsonl(RECORDS), model=minilm.name, params=_nested(20_000))
    _assert_refused(response, "params")
    assert not Job.objects.exists()


def test_params_may_nest_to_the_limit_and_no_deeper(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    uri = write_jsonl(RECORDS).as_uri()
    body = f'{{"model": "{minilm.name}", "input_uri": "{uri}", "params": {_nested(MAX_PARAMS_DEPTH + 1)}}}'
    error = _assert_refused(_post_json(alice, body, tmp_path), "params")
    assert error["message"] == f"params is nested deeper than {MAX_PARAMS_DEPTH} levels"

    # User code reads whatever params it likes, so only the depth limit stands between it and these.
    user_code = ModelFactory(
        name="nesting-echo",
        engine=Model.Engine.PYTHON,
        task=Model.Task.EMBED,
        source="tests.support.chaos_engines:echo_factory",
        is_default=False,
    )
    at_limit = f'{{"model": "{user_code.name}", "input_uri": "{uri}", "params": {_nested(MAX_PARAMS_DEPTH)}}}'
    response = _post_json(alice, at_limit, tmp_path)
    assert response.status_code == 201, response.json()


def test_a_param_the_models_engine_cannot_honour_is_a_400_naming_it(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path
) -> None:
    alice = caller("acme")
    uri = write_jsonl(RECORDS).as_uri()
    body = json.dumps({"model": minilm.name, "input_uri": uri, "params": {"temperature": 0.5}})

    error = _assert_refused(_post_json(alice, body, tmp_path), "params")

    assert error["message"].startswith("params.temperature is not a parameter the sentence_transformers engine")


def test_params_over_the_size_limit_are_a_400_naming_params(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    params = json.dumps({"padding": "x" * MAX_PARAMS_BYTES})
    error = _assert_refused(_upload(alice, write_jsonl(RECORDS), model=minilm.name, params=params), "params")
    assert f"over the limit of {MAX_PARAMS_BYTES}" in error["message"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [('"nul \\u0000"', "NUL character"), ('"lone \\ud800"', "surrogates not allowed")],
    ids=["nul", "lone-surrogate"],
)
def test_params_that_postgresql_cannot_store_are_a_400_naming_params(
    caller: Callable[..., Caller],
    minilm: Any,
    write_jsonl: Callable[..., Path],
    tmp_path: Path,
    value: str,
    expected: str,
) -> None:
    alice = caller("acme")
    uri = write_jsonl(RECORDS).as_uri()
    body = f'{{"model": "{minilm.name}", "input_uri": "{uri}", "params": {{"stop": {value}}}}}'
    error = _assert_refused(_post_json(alice, body, tmp_path), "params")
    assert expected in error["message"]


@pytest.mark.parametrize(
    "params",
    [
        {"time_limit_base_s": "soon"},
        {"time_limit_per_record_s": -1},
        {"time_limit_base_s": 10**30},
        {"micro_batch_size": 2.5},
        {"micro_batch_size": True},
    ],
    ids=["text", "negative", "huge", "fraction", "boolean"],
)
def test_a_platform_param_of_the_wrong_kind_is_a_400_naming_it(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path, params: dict[str, Any]
) -> None:
    """The scheduler reads these when it sends the job's shards; refused here, they cannot stall the queue."""
    alice = caller("acme")
    body = json.dumps({"model": minilm.name, "input_uri": write_jsonl(RECORDS).as_uri(), "params": params})
    error = _assert_refused(_post_json(alice, body, tmp_path), "params")
    assert f"params.{next(iter(params))} must be" in error["message"]
    assert not Job.objects.exists()


# integers and numbers that overflow a column or a date


@pytest.mark.parametrize("shard_size", [10**30, 2**31, MAX_SHARD_SIZE + 1])
def test_a_shard_size_over_the_bound_is_a_400_naming_shard_size(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path], tmp_path: Path, shard_size: int
) -> None:
    alice = caller("acme")
    uri = write_jsonl(RECORDS).as_uri()
    body = json.dumps({"model": minilm.name, "input_uri": uri, "shard_size": shard_size})
    error = _assert_refused(_post_json(alice, body, tmp_path), "shard_size")
    assert str(MAX_SHARD_SIZE) in error["message"]
    form = _upload(alice, write_jsonl(RECORDS), model=minilm.name, shard_size=str(shard_size))
    _assert_refused(form, "shard_size")
    assert not Job.objects.exists()


def test_a_deadline_too_far_to_be_a_date_is_a_400_naming_deadline_seconds(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    response = _upload(alice, write_jsonl(RECORDS), model=minilm.name, deadline_seconds="1e300")
    _assert_refused(response, "deadline_seconds")
    assert not Job.objects.exists()


# input records whose input has the wrong type


def test_an_object_where_the_input_text_belongs_is_a_400_naming_the_line_and_the_field(
    caller: Callable[..., Caller], minilm: Any, write_jsonl: Callable[..., Path]
) -> None:
    alice = caller("acme")
    path = write_jsonl([*RECORDS[:2], {"custom_id": "a", "input": {"x": 1}}])
    error = _assert_refused(_upload(alice, path, model=minilm.name), "file")
    assert error["lines"] == [{"line": 3, "message": "input must be a string, not an object"}]
    assert "line 3: input must be a string, not an object" in error["message"]
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("task", "record", "expected"),
    [
        ("generate", {"prompt": ["a", "list"]}, "prompt must be a string, not an array"),
        ("chat", {"messages": "hello"}, "messages must be a non-empty array of message objects, not a string"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}, 7]}, "messages must hold message objects"),
    ],
)
def test_each_task_refuses_a_wrongly_typed_input_up_front(
    caller: Callable[..., Caller],
    write_jsonl: Callable[..., Path],
    task: str,
    record: dict[str, Any],
    expected: str,
) -> None:
    ModelFactory(name=f"tiny-{task}", engine=Model.Engine.TRANSFORMERS, task=task, is_default=False)
    alice = caller("acme")
    good = {"prompt": "fine"} if task == "generate" else {"messages": [{"role": "user", "content": "hi"}]}
    refused = _upload(alice, write_jsonl([good, record]), model=f"tiny-{task}")
    error = _assert_refused(refused, "file")
    assert error["lines"][0]["line"] == 2
    assert error["lines"][0]["message"].startswith(expected)
    assert _upload(alice, write_jsonl([good, good]), model=f"tiny-{task}").status_code == 201


def test_an_input_too_large_to_check_at_submission_is_refused_by_the_planner_for_a_wrong_type(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path], settings: Any
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    # One shard holds the whole input, so the bad line is met before any shard is written (the slow start
    # would end one after the first record: a job whose shards ran before its bad line is planning's test).
    settings.BATCHERY_FIRST_SHARD_SECONDS = 0
    job = job_submit(
        tenant=acme,
        request=JobRequest(model_name=minilm.name, input_uri=str(write_jsonl([*RECORDS, {"input": {"x": 1}}]))),
    )

    job_plan(job_id=str(job.id))

    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "line 4: input must be a string, not an object" in job.error
    assert not Shard.objects.filter(job=job).exists()


# the service, for callers other than the API (the CLI, the portal form)


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"shard_size": 10**30}, "shard_size"),
        ({"deadline_seconds": float("nan")}, "deadline_seconds"),
        ({"deadline_seconds": 1e300}, "deadline_seconds"),
        ({"params": {"temperature": float("nan")}}, "params"),
        ({"params": {"stop": {"x"}}}, "params"),
    ],
    ids=["huge-shard-size", "nan-deadline", "huge-deadline", "nan-in-params", "set-in-params"],
)
def test_the_service_refuses_values_the_database_cannot_hold_naming_the_field(
    acme: Any, minilm: Any, write_jsonl: Callable[..., Path], arguments: dict[str, Any], field: str
) -> None:
    with pytest.raises(SubmissionError) as refused:
        job_submit(
            tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(write_jsonl(RECORDS)), **arguments)
        )
    assert refused.value.field == field
    assert not Job.objects.exists()


def test_a_batch_body_nested_20000_levels_deep_is_a_400_naming_metadata(caller: Callable[..., Caller]) -> None:
    alice = caller("acme")
    fields = '"input_file_id": "file-x", "endpoint": "/v1/embeddings", "completion_window": "24h"'
    body = f'{{{fields}, "metadata": {_nested(20_000)}}}'

    response = alice.client.post("/v1/batches", body, content_type="application/json")

    assert response.status_code == 400
    assert response.json()["error"]["message"] == "JSON parse error - metadata is nested too deeply to read"
