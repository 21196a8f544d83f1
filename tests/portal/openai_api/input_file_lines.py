"""Lines of OpenAI batch input files, and their conversion to records, for the input-file tests."""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import orjson

from portal.openai_api.formats.input_file import RequestConversion, convert_requests

EMBEDDINGS, COMPLETIONS, CHAT = "/v1/embeddings", "/v1/completions", "/v1/chat/completions"
MAX_LINE_BYTES = 1024
INPUTS = {
    EMBEDDINGS: ("input", "a sentence to embed"),
    COMPLETIONS: ("prompt", "Once upon a time"),
    CHAT: ("messages", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
}


def request(custom_id: str = "r1", *, url: str = EMBEDDINGS, model: str = "m", **fields: Any) -> dict[str, Any]:
    """One line of an OpenAI batch input file; the endpoint's input is filled in unless given."""
    input_field, value = INPUTS[url]
    body = {"model": model, input_field: value, **fields}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(*lines: dict[str, Any] | bytes | str) -> list[bytes]:
    """File lines, newline-terminated: objects as JSON, bytes and text as given."""
    out = []
    for line in lines:
        raw = line if isinstance(line, bytes) else line.encode() if isinstance(line, str) else orjson.dumps(line)
        out.append(raw + b"\n")
    return out


def convert(
    source: Iterable[bytes], *, endpoint: str = EMBEDDINGS, **options: Any
) -> tuple[RequestConversion, list[dict[str, Any]]]:
    target = io.BytesIO()
    options.setdefault("max_line_bytes", MAX_LINE_BYTES)
    result = convert_requests(source, target, endpoint=endpoint, **options)
    written = target.getvalue()
    assert written == b"" or written.endswith(b"\n")
    return result, [orjson.loads(line) for line in written.splitlines()]


def codes(result: RequestConversion) -> list[tuple[int | None, str]]:
    return [(problem.line, problem.code) for problem in result.problems]
