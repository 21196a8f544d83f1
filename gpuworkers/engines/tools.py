"""Tool calls: OpenAI's ``tools`` with ``tool_choice`` ``required``, a named function, or ``auto``.

A model's own tool-call syntax differs from family to family, and reading it back needs a parser written for
that family. Constrained decoding needs none: for ``required`` and a named function the reply is held to a
JSON Schema of the calls (as vLLM's own server does for these two choices), so any model vLLM serves can call
tools, and the calls always parse. ``tool_choice`` ``auto`` (the default with tools), where the model decides
in its own syntax whether to call at all, is read back by vLLM's tool parser for the model's family, named
by its catalog entry (load param ``tool_call_parser``, as vLLM's ``--tool-call-parser``); for a model whose
entry names none it is refused. ``none`` is plain text. The tools also go to the chat template, which tells
the model what it may call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuworkers.engines.sampling import ParamError, SchemaRefused, check_schema_bounds, structured_output

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for a function's name."""

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCalls:
    """How one request's tool calls are decoded and read back."""

    tools: tuple[dict[str, Any], ...]
    """The request's tools, as given: the chat template renders them."""
    schema: dict[str, Any] | None
    """The JSON Schema the reply is held to; None for ``auto``: the model replies in its own syntax."""
    named: str | None
    """The function ``tool_choice`` names: the reply is its arguments alone. None: a list of calls."""
    parser: str | None = None
    """``auto``: the vLLM tool parser that reads the calls back from the model's own syntax."""

    def calls(self, text: str) -> list[dict[str, str]] | None:
        """The calls a reply holds, each ``{"name", "arguments"}`` (arguments as JSON text), or None where
        the reply is not whole JSON (decoding stopped at ``max_tokens``). Not for ``auto``: its parser reads it."""
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return [{"name": self.named, "arguments": json.dumps(parsed)}]
        if not isinstance(parsed, list):
            return None
        return [
            {"name": str(call["name"]), "arguments": json.dumps(call["parameters"])}
            for call in parsed
            if isinstance(call, dict) and "name" in call and "parameters" in call
        ]


def tool_calls(params: Mapping[str, Any], *, tool_parser: str | None = None) -> ToolCalls | None:
    """What ``tools`` and ``tool_choice`` ask of decoding; None when the reply is plain text.

    `tool_parser` is the model's vLLM tool parser (its catalog entry's ``tool_call_parser``). Raises
    `ParamError` naming the field for a shape OpenAI would refuse, and for ``tool_choice`` ``auto`` (the
    default with tools) where the model has no tool parser.
    """
    tools, choice = params.get("tools"), params.get("tool_choice")
    parallel = params.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError("parallel_tool_calls", f"parallel_tool_calls must be true or false, not {parallel!r}")
    if tools is None:
        if choice not in (None, "none"):
            raise ParamError("tool_choice", "tool_choice needs tools to choose from")
        return None
    checked = _checked_tools(tools)
    if choice is None or choice == "auto":
        if tool_parser is None:
            raise ParamError(
                "tool_choice",
                "tool_choice 'auto' (the default with tools) needs the model's own tool-call parser, and this "
                "model's catalog entry names none (load param tool_call_parser); ask for 'required', or name a "
                "function, and the calls are decoded to the tools' schemas",
            )
        return ToolCalls(tools=checked, schema=None, named=None, parser=tool_parser)
    if choice == "none":
        return None
    if choice == "required":
        return ToolCalls(tools=checked, schema=_required_schema(checked, parallel=parallel), named=None)
    name = _named_function(choice)
    chosen = next((tool["function"] for tool in checked if tool["function"]["name"] == name), None)
    if chosen is None:
        raise ParamError("tool_choice", f"tool_choice names function {name!r}, which is not among the tools")
    return ToolCalls(tools=checked, schema=_parameters(chosen), named=name)


def reply_format(params: Mapping[str, Any], calls: ToolCalls | None) -> dict[str, Any] | None:
    """The structured output a reply is held to (vLLM's fields): its tool calls' schema, or its
    ``response_format``; None for plain text. Raises `ParamError` when both would shape it."""
    structured = structured_output(params)
    if calls is None:
        return structured
    if structured is not None:
        raise ParamError("response_format", "response_format cannot be asked beside tool calls: both shape the reply")
    if calls.schema is None:
        return None
    # The tools' schemas are compiled together, into the grammar the reply is held to.
    check_schema_bounds("tools", calls.schema)
    return {"json": calls.schema}


def check_reply_schema_bounds(params: Mapping[str, Any]) -> None:
    """Raise `SchemaRefused` where a schema ``params`` give is one a slot does not compile: their
    ``response_format``'s, or their tools' (as ``tool_choice`` ``required`` holds a reply to all of them, the
    largest schema they make). For a record's own params, judged alone; their other faults are the engine's."""
    try:
        structured_output(params)
    except SchemaRefused:
        raise
    except ParamError:
        pass
    try:
        checked = _checked_tools(params["tools"]) if params.get("tools") is not None else ()
    except ParamError:
        return
    if checked:
        check_schema_bounds("tools", _required_schema(checked, parallel=None))


def _required_schema(tools: Sequence[Mapping[str, Any]], *, parallel: bool | None) -> dict[str, Any]:
    """The schema of a reply of one or more calls of these tools."""
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_call_schema(tool["function"]) for tool in tools]},
    }
    if parallel is False:
        schema["maxItems"] = 1
    return schema


def _checked_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise ParamError("tools", "tools must be a non-empty list of function tools")
    names: set[str] = set()
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ParamError("tools", f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
        name = tool["function"].get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise ParamError("tools", f"tools[{index}].function.name must be 1 to 64 letters, digits, _ or -")
        if name in names:
            raise ParamError("tools", f"tools[{index}].function.name {name!r} is given twice")
        names.add(name)
        parameters = tool["function"].get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ParamError("tools", f"tools[{index}].function.parameters must be a JSON Schema object")
    return tuple(tools)


def _named_function(choice: Any) -> str:
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        return str(choice["function"]["name"])
    raise ParamError(
        "tool_choice",
        f'tool_choice must be one of {", ".join(TOOL_CHOICES)} or {{"type": "function", "function": {{"name": ...}}}}',
    )


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    # A function without parameters takes an empty object, as OpenAI reads it.
    return dict(function.get("parameters") or {"type": "object", "properties": {}})


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": _parameters(function)},
        "required": ["name", "parameters"],
    }


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A key that is equal for equal tool lists: prompts with the same tools share one chat call."""
    return json.dumps(tools, sort_keys=True) if tools else ""
