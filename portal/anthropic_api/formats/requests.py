"""One request of a message batch, ``{"custom_id", "params"}`` with Anthropic's Messages API params, as a chat
record and the chat engine's params.

A message batch runs as a Batchery job of task ``chat``: each request becomes a record ``{"custom_id",
"messages"}`` in OpenAI's message shape (the engines' own), and its params are renamed to the engine's
(``stop_sequences`` to ``stop``, Anthropic's ``tools`` and ``tool_choice`` to OpenAI's). Text is served, and
images given inline (``source`` of type ``base64``), which become OpenAI's ``image_url`` parts with a ``data:``
URL for the caller to judge against the model (`gpuworkers.engines.media`); an image by URL (GPU hosts fetch
nothing a request names) and a content block of any other type (documents, tool results) are refused naming
it, and so is a Messages API param this conversion does not know, rather than dropped. Whether the engine of the model
can honour the converted params is judged by the caller (`check_request_params`), whose field names
`anthropic_field` turns back into the request's.

Two kinds of refusal, as Anthropic draws the line: a request that is not ``{"custom_id", "params": {...}}``
(`request_parts`) makes the batch malformed, refused whole at creation; anything wrong inside its ``params``
(`convert_request`) is that request's alone, which errors in the results while the others run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ANTHROPIC_VERSIONS = ("2023-06-01", "2026-10-21")
"""The ``anthropic-version`` headers served: the long-standing one, and the one the SDK's 2.x majors send."""

SAMPLING_REMOVED_VERSION = "2026-10-21"
"""From this version Anthropic refuses ``temperature``, ``top_p`` and ``top_k``, even at their defaults."""

SAMPLING_PARAMS = ("temperature", "top_p", "top_k")

CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""Anthropic's rule for a request's ``custom_id``."""

SERVED_PARAMS = frozenset(
    {
        "model",
        "max_tokens",
        "messages",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "tools",
        "tool_choice",
        "metadata",
        "stream",
    }
)
"""The Messages API params a request may give; any other is refused naming it."""

ROLES = ("user", "assistant")

TEXT_BLOCK_FIELDS = frozenset({"type", "text", "cache_control", "citations"})
"""A text block's fields; ``cache_control`` changes nothing here (no prompt cache), ``citations`` must be empty."""

IMAGE_BLOCK_FIELDS = frozenset({"type", "source", "cache_control"})

IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
"""The ``media_type``s of an image block Anthropic takes."""

TOOL_FIELDS = frozenset({"name", "description", "input_schema", "type", "cache_control"})

TOOL_CHOICES: Mapping[str, str] = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's ``tool_choice.type`` to OpenAI's ``tool_choice``; ``tool`` names a function."""

ENGINE_FIELDS: tuple[tuple[str, str], ...] = (
    ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    ("stop", "stop_sequences"),
)
"""Engine param names and what a Messages API request calls them; the others are named alike."""


class RequestRefused(ValueError):
    """A request of the batch that cannot run; ``field`` is its path inside the request (``params.max_tokens``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ChatRequest:
    """One batch request converted: what the job's record and params hold for it."""

    custom_id: str
    model: str
    """The model the request names, as given."""
    messages: list[dict[str, Any]]
    """The conversation in the chat engine's shape: the system prompt first; string contents, or a turn's
    content parts block for block where it holds images."""
    params: dict[str, Any]
    """The chat engine's params: ``max_tokens``, and the optional ones the request gives."""


def request_parts(request: Any) -> tuple[str, Mapping[str, Any]]:
    """The ``custom_id`` and ``params`` of one element of ``requests``; raises `RequestRefused` naming the field
    where the element itself is malformed, which makes the whole batch malformed (Anthropic answers 400)."""
    if not isinstance(request, Mapping):
        raise RequestRefused("", "must be an object {custom_id, params}")
    unknown = sorted(set(request) - {"custom_id", "params"})
    if unknown:
        raise RequestRefused(unknown[0], "Extra inputs are not permitted")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
        raise RequestRefused("custom_id", "must be 1 to 64 characters of letters, digits, _ and -")
    params = request.get("params")
    if not isinstance(params, Mapping):
        raise RequestRefused("params", "must be an object of Messages API params")
    return custom_id, params


def convert_request(custom_id: str, params: Mapping[str, Any], *, version: str) -> ChatRequest:
    """Convert one request's ``params``; raises `RequestRefused` naming the field (``params.…``) for anything this
    platform cannot run as Anthropic would answer it, under ``anthropic-version`` ``version``: that request
    errors, alone."""
    unknown = sorted(set(params) - SERVED_PARAMS)
    if unknown:
        served = ", ".join(sorted(SERVED_PARAMS))
        raise RequestRefused(f"params.{unknown[0]}", f"is not a Messages API param served here; served: {served}")
    model = params.get("model")
    if not isinstance(model, str) or not model:
        raise RequestRefused("params.model", "is required: a model's name")
    if params.get("max_tokens") is None:
        raise RequestRefused("params.max_tokens", "is required")
    if params.get("stream") not in (None, False):
        raise RequestRefused("params.stream", "must be false or left out: a batch's responses do not stream")
    metadata = params.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise RequestRefused("params.metadata", "must be an object")
    messages = _system(params.get("system")) + _messages(params.get("messages"))
    return ChatRequest(custom_id=custom_id, model=model, messages=messages, params=_engine_params(params, version))


def anthropic_field(engine_field: str) -> str:
    """An engine param's name (or a path that starts with one, ``tools``...) as a Messages API request names it."""
    for engine_name, request_name in ENGINE_FIELDS:
        if engine_field == engine_name or engine_field.startswith(engine_name + "."):
            return request_name + engine_field[len(engine_name) :]
    return engine_field


_CONVERTED_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\]")


def request_part(where: str, converted: ChatRequest) -> str:
    """A content part's place in the converted conversation (``messages[2].content[1]``, as
    `gpuworkers.engines.media` names it) as the request names its block (``params.messages.1.content.1``)."""
    match = _CONVERTED_PART.match(where)
    if match is None:
        return "params.messages"
    # Only the system prompt becomes a turn of role system, always the first.
    offset = 1 if converted.messages[0]["role"] == "system" else 0
    return f"params.messages.{int(match[1]) - offset}.content.{match[2]}"


def _engine_params(params: Mapping[str, Any], version: str) -> dict[str, Any]:
    engine: dict[str, Any] = {"max_tokens": params["max_tokens"]}
    for name in SAMPLING_PARAMS:
        if params.get(name) is None:
            continue
        if version >= SAMPLING_REMOVED_VERSION:
            raise RequestRefused(
                f"params.{name}",
                f"Extra inputs are not permitted under anthropic-version {version}; "
                f"send anthropic-version {ANTHROPIC_VERSIONS[0]} to set it",
            )
        engine[name] = params[name]
    temperature = params.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 1
    ):
        raise RequestRefused("params.temperature", f"must be a number from 0 to 1, not {temperature!r}")
    stop = params.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(item, str) and item for item in stop):
            raise RequestRefused("params.stop_sequences", "must be a list of non-empty strings")
        if stop:
            engine["stop"] = stop
    if params.get("tools") is not None:
        engine["tools"] = _tools(params["tools"])
    if params.get("tool_choice") is not None:
        engine.update(_tool_choice(params["tool_choice"]))
    return engine


def _text(content: Any, field: str, *, images: bool = False) -> str:
    """A string, or a list of text blocks joined: the text a turn (or the system prompt) holds; `images`: a turn
    may hold image blocks too, which the refusal of another block says."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RequestRefused(field, "must be a string or a non-empty list of text blocks")
    return "".join(_text_block(block, f"{field}.{index}", images=images) for index, block in enumerate(content))


def _content(content: Any, field: str) -> str | list[dict[str, Any]]:
    """A turn's content: its text, or, where it holds image blocks, OpenAI's content parts block for block."""
    if not isinstance(content, list) or not any(isinstance(block, Mapping) and _is_image(block) for block in content):
        return _text(content, field, images=True)
    return [
        _image_part(block, f"{field}.{index}")
        if _is_image(block)
        else {"type": "text", "text": _text_block(block, f"{field}.{index}", images=True)}
        for index, block in enumerate(content)
    ]


def _is_image(block: Mapping[str, Any]) -> bool:
    return block.get("type") == "image"


def _text_block(block: Any, where: str, *, images: bool) -> str:
    if not isinstance(block, Mapping):
        raise RequestRefused(where, 'must be a content block {"type": "text", "text": ...}')
    if block.get("type") != "text":
        served = "'text' blocks and inline 'image' blocks are" if images else "only 'text' blocks are"
        raise RequestRefused(
            f"{where}.type", f"content blocks of type {block.get('type')!r} are not served here; {served}"
        )
    unknown = sorted(set(block) - TEXT_BLOCK_FIELDS)
    if unknown:
        raise RequestRefused(f"{where}.{unknown[0]}", "Extra inputs are not permitted")
    if block.get("citations"):
        raise RequestRefused(f"{where}.citations", "citations are not served here; leave them out")
    if not isinstance(block.get("text"), str):
        raise RequestRefused(f"{where}.text", "must be a string")
    return str(block["text"])


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An inline image block as OpenAI's ``image_url`` part of a ``data:`` URL; an image by URL is refused."""
    unknown = sorted(set(block) - IMAGE_BLOCK_FIELDS)
    if unknown:
        raise RequestRefused(f"{where}.{unknown[0]}", "Extra inputs are not permitted")
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise RequestRefused(f"{where}.source", 'must be an object {"type": "base64", "media_type", "data"}')
    if source.get("type") != "base64":
        raise RequestRefused(
            f"{where}.source.type",
            f"image sources of type {source.get('type')!r} are not served here: GPU hosts fetch nothing a request "
            "names; give the image inline, as a 'base64' source",
        )
    media_type, data = source.get("media_type"), source.get("data")
    if media_type not in IMAGE_MEDIA_TYPES:
        raise RequestRefused(f"{where}.source.media_type", f"must be one of {', '.join(IMAGE_MEDIA_TYPES)}")
    if not isinstance(data, str) or not data:
        raise RequestRefused(f"{where}.source.data", "must be the image's bytes in base64")
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text(system, "params.system")
    return [{"role": "system", "content": text}] if text else []


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestRefused("params.messages", "is required: a non-empty list of {role, content}")
    converted = []
    for index, message in enumerate(messages):
        where = f"params.messages.{index}"
        if not isinstance(message, Mapping):
            raise RequestRefused(where, "must be an object {role, content}")
        if message.get("role") not in ROLES:
            raise RequestRefused(f"{where}.role", f"must be 'user' or 'assistant', not {message.get('role')!r}")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise RequestRefused(f"{where}.{unknown[0]}", "Extra inputs are not permitted")
        converted.append({"role": message["role"], "content": _content(message.get("content"), f"{where}.content")})
    return converted


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic's client tools ``{name, description, input_schema}`` as OpenAI's function tools."""
    if not isinstance(tools, list) or not tools:
        raise RequestRefused("params.tools", "must be a non-empty list of tools {name, description, input_schema}")
    converted = []
    for index, tool in enumerate(tools):
        where = f"params.tools.{index}"
        if not isinstance(tool, Mapping):
            raise RequestRefused(where, "must be a tool {name, description, input_schema}")
        if tool.get("type") not in (None, "custom"):
            # Server tools (web search, code execution...) run on Anthropic's side; there is none here.
            raise RequestRefused(f"{where}.type", f"tools of type {tool.get('type')!r} are not served here")
        unknown = sorted(set(tool) - TOOL_FIELDS)
        if unknown:
            raise RequestRefused(f"{where}.{unknown[0]}", "Extra inputs are not permitted")
        if not isinstance(tool.get("name"), str):
            raise RequestRefused(f"{where}.name", "must be a string")
        if not isinstance(tool.get("input_schema"), Mapping):
            raise RequestRefused(f"{where}.input_schema", "is required: a JSON Schema object")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestRefused(f"{where}.description", "must be a string")
        function: dict[str, Any] = {"name": tool["name"], "parameters": dict(tool["input_schema"])}
        if description:
            function["description"] = description
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as OpenAI's ``tool_choice`` (and ``parallel_tool_calls``)."""
    if not isinstance(choice, Mapping) or choice.get("type") not in (*TOOL_CHOICES, "tool"):
        raise RequestRefused("params.tool_choice", "must be an object whose type is auto, any, tool or none")
    params: dict[str, Any] = {}
    if choice["type"] == "tool":
        if not isinstance(choice.get("name"), str):
            raise RequestRefused("params.tool_choice.name", "is required with type 'tool': the tool's name")
        params["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        params["tool_choice"] = TOOL_CHOICES[choice["type"]]
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise RequestRefused("params.tool_choice.disable_parallel_tool_use", "must be true or false")
    if disable:
        params["parallel_tool_calls"] = False
    return params
