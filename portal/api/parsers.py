"""The API's JSON parser: DRF's, reading at most `BATCHERY_MAX_REQUEST_BYTES`, and answering 400
instead of 500 to a body nested too deeply to parse.

Python's JSON decoder recurses once per level of nesting, so a body of a few thousand `[` raises
RecursionError, which DRF does not catch. The limits on what a field may hold (params: depth and
size) are the services'; this only keeps the parser itself from failing.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework import parsers, status

from portal.api.errors import ApiError

_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[][{},]')
_DEEP = 100
"""Deeper than any field of any request the API takes; a value past it is the one to name."""


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser; a body over the size limit is a 413 and one nested deeper than the decoder can
    go a 400 naming its field."""

    def parse(
        self, stream: IO[bytes], media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        limit = settings.BATCHERY_MAX_REQUEST_BYTES
        body = stream.read(limit + 1)
        if len(body) > limit:
            raise ApiError(
                f"the request body is over the limit of {limit} bytes (BATCHERY_MAX_REQUEST_BYTES)",
                status_code=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
                code="payload_too_large",
            )
        try:
            return super().parse(io.BytesIO(body), media_type, parser_context)
        except RecursionError:
            pass  # answered below, once the decoder's frames are gone
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        field = deep_field(body.decode(encoding, errors="replace"))
        where = field or "the request body"
        raise ApiError(
            f"JSON parse error - {where} is nested too deeply to read",
            status_code=status.HTTP_400_BAD_REQUEST,
            code="parse_error",
            param=field,
            **({"fields": {field: ["is nested too deeply to read"]}} if field else {}),
        )


def deep_field(text: str) -> str | None:
    """The top-level key of the JSON object in `text` whose value is the first to nest past `_DEEP`
    levels; None if none does, or the body is no object.

    `text` needs to be valid JSON only up to that point, which is where the decoder gave up.
    """
    depth = 0
    in_object = False
    expect_key = False
    key: str | None = None
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > _DEEP:
                return key
            if depth == 1:
                in_object = expect_key = token == "{"
        elif token in ("]", "}"):
            depth -= 1
        elif token == ",":
            expect_key = depth == 1 and in_object
        elif expect_key and depth == 1:
            key = json.loads(token)
            expect_key = False
    return None
