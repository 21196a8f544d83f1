"""``tool_choice`` ``auto`` on the vllm engine: the model replies in its own tool-call syntax, and vLLM's tool
parser for its family reads the calls back, as vLLM's OpenAI server does with ``--enable-auto-tool-choice
--tool-call-parser NAME``. The catalog entry names the parser (load param ``tool_call_parser``).

A parser may ask for the request to change (Hermes' keeps the special tokens that frame its calls in the
text): each prompt's request goes through its ``adjust_request`` before the sampling params are built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuworkers.engines.base import EngineLoadError


def tool_parser_class(name: Any) -> Any:
    """vLLM's tool parser class of that name; a load error naming the parsers vLLM has where it has none."""
    if not isinstance(name, str):
        raise EngineLoadError(f"load param tool_call_parser must be the name of a vLLM tool parser, not {name!r}")
    manager = _parser_manager()
    try:
        return manager.get_tool_parser(name)
    except KeyError:
        listed = getattr(manager, "list_registered", None)
        known = listed() if listed is not None else sorted(manager.tool_parsers)
        raise EngineLoadError(
            f"load param tool_call_parser names {name!r}, which is not a vLLM tool parser; vLLM has {', '.join(known)}"
        ) from None


def tool_parser(parser_class: Any, tokenizer: Any) -> Any:
    """The parser for the model whose tokenizer this is; a load error where it cannot read its replies."""
    try:
        return parser_class(tokenizer)
    except Exception as exc:
        # Hermes' parser, say, refuses a tokenizer without its <tool_call> tokens: the model is not of its family.
        raise EngineLoadError(
            f"vLLM's tool parser {parser_class.__name__} cannot read this model's replies: {type(exc).__name__}: {exc}"
        ) from exc


def auto_request(parser: Any, *, model: str, messages: Sequence[Any], tools: Sequence[Mapping[str, Any]]) -> Any:
    """The chat request vLLM's parser reads one prompt's reply against, as the parser adjusted it."""
    request = _chat_request_class()(model=model, messages=list(messages), tools=list(tools), tool_choice="auto")
    return parser.adjust_request(request)


def sampling_changes(request: Any) -> dict[str, Any]:
    """What the parser's adjusted request changes in the prompt's sampling params."""
    return {"skip_special_tokens": bool(request.skip_special_tokens)}


def read_auto_calls(sample: dict[str, Any], parser: Any, request: Any) -> None:
    """Read one sample's reply with the parser: a reply that calls tools gets ``tool_calls``, finish_reason
    ``tool_calls`` and what text came with the calls; any other reply stays as it is."""
    found = parser.extract_tool_calls(sample["text"], request)
    if found.tools_called and found.tool_calls:
        calls = [{"name": call.function.name, "arguments": call.function.arguments} for call in found.tool_calls]
        sample.update(text=found.content or "", tool_calls=calls, finish_reason="tool_calls")


def _parser_manager() -> Any:
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager


def _chat_request_class() -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest
