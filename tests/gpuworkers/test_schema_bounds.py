"""A schema compiled into a grammar on a shared slot is bounded: in bytes, nesting depth and properties, named by
its field, wherever params are judged (a job's, an OpenAI line's, a record's own, and the engine's)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.batching import Item, run_records
from gpuworkers.engines.request_params import check_request_params
from gpuworkers.engines.sampling import ParamError, SchemaRefused, structured_output
from gpuworkers.engines.tools import check_reply_schema_bounds, reply_format, tool_calls
from tests.gpuworkers.test_vllm_engine import fake_vllm, loaded  # noqa: F401 (fake_vllm: a fixture)
from tests.support.vllm_standins import vllm_spec


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def wide(properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{n}": {"type": "integer"} for n in range(properties)}}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def test_a_schema_within_the_bounds_is_held_to() -> None:
    assert structured_output(response_format(wide(10))) == {"json": wide(10)}


def test_a_schema_nested_too_deep_is_refused_without_recursing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_DEPTH", "8")
    structured_output(response_format(nested(3)))
    with pytest.raises(SchemaRefused) as refused:
        structured_output(response_format(nested(5_000)))
    assert refused.value.field == "response_format.json_schema.schema"
    assert "nests deeper than 8 levels" in str(refused.value)
    assert "BATCHERY_MAX_JSON_SCHEMA_DEPTH" in str(refused.value)


def test_a_schema_of_too_many_properties_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_PROPERTIES", "50")
    structured_output(response_format(wide(50)))
    with pytest.raises(SchemaRefused, match=r"more than 50 properties.*BATCHERY_MAX_JSON_SCHEMA_PROPERTIES"):
        structured_output(response_format(wide(51)))


def test_a_schema_of_too_many_bytes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_BYTES", "1000")
    schema = {"type": "string", "enum": ["x" * 100 for _ in range(20)]}
    with pytest.raises(SchemaRefused, match=r"is \d+ bytes, over this platform's limit of 1000"):
        structured_output(response_format(schema))


def test_the_tools_a_reply_is_decoded_to_are_bounded_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_PROPERTIES", "50")
    tools = [{"type": "function", "function": {"name": f"f{n}", "parameters": wide(10)}} for n in range(5)]
    params = {"tools": tools, "tool_choice": "required"}
    with pytest.raises(SchemaRefused) as refused:
        reply_format(params, tool_calls(params))
    assert refused.value.field == "tools"
    with pytest.raises(SchemaRefused):
        check_reply_schema_bounds({"tools": tools})  # a record's own tools, whatever tool_choice the job gives


def test_a_jobs_params_are_refused_at_submission_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_DEPTH", "8")
    with pytest.raises(ParamError) as refused:
        check_request_params("vllm", "chat", response_format(nested(20)))
    assert refused.value.field == "response_format.json_schema.schema"


def test_a_records_own_params_other_faults_are_left_to_the_engine() -> None:
    check_reply_schema_bounds({"response_format": {"type": "nonsense"}, "tools": "not a list"})


def test_on_the_slot_a_records_schema_over_the_bounds_errors_that_record_alone_before_vllm_compiles_it(
    fake_vllm: types.ModuleType,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_PROPERTIES", "5")
    engine, llm = loaded(vllm_spec(tmp_path, task="chat"))
    hi = [{"role": "user", "content": "hi"}]
    items = [Item("plain", hi), Item("wide", hi, response_format(wide(6))), Item("fits", hi, response_format(wide(5)))]

    results = {result.custom_id: result for result in run_records(engine, items, params={}, micro_batch_size=8)}

    assert results["plain"].response is not None and results["fits"].response is not None
    error = results["wide"].error
    assert error is not None and "response_format.json_schema.schema has more than 5 properties" in error["message"]
    given = [params.kwargs.get("structured_outputs") for call in llm.calls for params in call[2]]
    assert ("structured", {"json": wide(5)}) in given
    assert ("structured", {"json": wide(6)}) not in given


@pytest.mark.parametrize(
    "reference",
    ["http://169.254.169.254/latest/meta-data/", "file:///etc/passwd", "other.json#/x", {"not": "a string"}],
)
def test_a_schema_that_refers_to_another_document_is_refused(reference: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": reference}}}
    with pytest.raises(ParamError) as refused:
        structured_output(response_format(schema))
    assert refused.value.field == "response_format.json_schema.schema" and "$ref" in str(refused.value)


def test_a_schema_that_refers_within_itself_is_held_to() -> None:
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}
    assert structured_output(response_format(schema)) == {"json": schema}
