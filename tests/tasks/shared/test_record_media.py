"""Every route's line check (`tasks.shared.formats.jsonl.parse_line`) refuses, naming the line, a chat record whose
media a slot would fetch, a content part not served, and a record's own schema over the bounds."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tasks.shared.formats.jsonl import parse_line
from tasks.shared.formats.records import LineProblem, Record


def line(messages: Any, **fields: Any) -> bytes:
    return orjson.dumps({"custom_id": "r", "messages": messages, **fields})


def image_at(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:9/", "https://10.0.0.1/"]
)
def test_a_chat_record_naming_a_private_or_metadata_address_is_refused_naming_the_line(url: str) -> None:
    problem = parse_line(line(image_at(url)), 7, "messages")
    assert isinstance(problem, LineProblem)
    assert str(problem).startswith("line 7: messages[0].content[0].image_url.url is ")
    assert "slots fetch nothing a record names" in problem.message


def test_a_record_in_an_openai_body_is_judged_alike() -> None:
    raw = orjson.dumps({"custom_id": "r", "body": {"messages": image_at("http://127.0.0.1/")}})
    assert isinstance(parse_line(raw, 1, "messages"), LineProblem)


def test_an_inline_image_within_the_bounds_passes_the_shape_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether the model takes images is the catalog's to say (`portal.jobs.record_checks`).
    assert isinstance(parse_line(line(image_at("data:image/png;base64,AAAA")), 1, "messages"), Record)
    monkeypatch.setenv("BATCHERY_MAX_MEDIA_BYTES", "10")
    problem = parse_line(line(image_at("data:image/png;base64,AAAA")), 1, "messages")
    assert isinstance(problem, LineProblem) and "BATCHERY_MAX_MEDIA_BYTES" in problem.message


def test_a_part_of_a_type_not_served_is_refused_naming_it() -> None:
    messages = [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "AAAA"}]}]
    problem = parse_line(line(messages), 2, "messages")
    assert isinstance(problem, LineProblem)
    assert problem.message.startswith("messages[0].content[0] is of type 'image_embeds', which is not served")


def test_a_records_own_schema_over_the_bounds_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_JSON_SCHEMA_PROPERTIES", "3")
    schema = {"type": "object", "properties": {name: {"type": "string"} for name in "abcd"}}
    params = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    problem = parse_line(line([{"role": "user", "content": "hi"}], params=params), 4, "messages")
    assert isinstance(problem, LineProblem)
    assert str(problem).startswith("line 4: params.response_format.json_schema.schema has more than 3 properties")


def test_a_records_own_schema_referring_to_a_url_is_refused_at_submission_naming_the_line() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "http://169.254.169.254/latest/meta-data/"}}}
    params = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    problem = parse_line(line([{"role": "user", "content": "hi"}], params=params), 5, "messages")
    assert isinstance(problem, LineProblem)
    assert str(problem).startswith("line 5: params.response_format.json_schema.schema holds a $ref")
