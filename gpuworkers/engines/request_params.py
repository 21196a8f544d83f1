"""Which request params each engine honours: a param no engine reads is refused, never dropped.

`check_request_params` judges one request's params (a job's, or one record's own) against the engine and
task that will run it, before anything runs: the portal calls it on every line of a batch, so a line asking
for what its model's engine cannot do is refused naming the line and the field. Engines raise the same
`ParamError` at run time for a spec written by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.sampling import SAMPLING_FIELDS, ParamError, sampling_kwargs
from gpuworkers.engines.tools import reply_format, tool_calls
from gpuworkers.engines.transformers import GenerationParams

ADAPTER_NOT_A_PARAM = (
    f"{ADAPTER_PARAM} is not a request parameter: name a LoRA adapter where the model is named (the job's model, "
    "a record's model field, an OpenAI request's body.model)"
)

PLATFORM_FIELDS = frozenset({"micro_batch_size", "time_limit_base_s", "time_limit_per_record_s"})
"""Params the platform reads when it sends and runs shards; taken by every engine."""

EMBEDDING_FIELDS = frozenset({"dimensions", "encoding_format"})
"""Every embedding engine's params: `gpuworkers.engines.embeddings` shortens, the output's conversion encodes."""

_FIELDS: Mapping[tuple[str, str], frozenset[str]] = {
    ("vllm", "generate"): SAMPLING_FIELDS | {"response_format"},
    ("vllm", "chat"): SAMPLING_FIELDS | {"response_format", "tools", "tool_choice", "parallel_tool_calls"},
    ("vllm", "embed"): EMBEDDING_FIELDS | {"truncate"},
    ("transformers", "generate"): GenerationParams.FIELDS,
    ("transformers", "chat"): GenerationParams.FIELDS,
    ("sentence_transformers", "embed"): EMBEDDING_FIELDS | {"batch_size", "normalize", "truncate"},
    ("transformers", "classify"): frozenset({"batch_size", "truncate"}),
}


def check_request_params(engine: str, task: str, params: Mapping[str, Any], *, tool_parser: str | None = None) -> None:
    """Raise `ParamError` naming the first field of ``params`` that ``engine`` cannot honour for ``task``.

    An engine of user code (``python``) reads what it likes, so its params are not judged. A field set to
    null is left out, as OpenAI's clients send it. `tool_parser`: the model's vLLM tool parser, which
    ``tool_choice`` ``auto`` needs.
    """
    known = _FIELDS.get((engine, task))
    if known is None:
        if ADAPTER_PARAM in params:
            raise ParamError(ADAPTER_PARAM, ADAPTER_NOT_A_PARAM)
        return
    given = {name: value for name, value in params.items() if value is not None}
    if ADAPTER_PARAM in params:
        raise ParamError(ADAPTER_PARAM, ADAPTER_NOT_A_PARAM)
    tool_field = next((name for name in ("tools", "tool_choice") if name in given), None)
    if tool_field is not None and tool_field not in known and engine != "vllm":
        raise ParamError(
            tool_field,
            f"{tool_field} is not supported by the {engine} engine: tool calls are decoded to the tools' schemas "
            "with structured output, which models served by the vllm engine have",
        )
    if "truncate" in given and not isinstance(given["truncate"], bool):
        raise ParamError("truncate", f"truncate must be true or false, not {given['truncate']!r}")
    for name in sorted(given):
        if name not in known and name not in PLATFORM_FIELDS:
            raise ParamError(
                name,
                f"{name} is not a parameter the {engine} engine honours for task {task!r}; "
                f"it takes {', '.join(sorted(known))}",
            )
    if engine == "vllm" and task != "embed":
        sampling_kwargs(given)
        reply_format(given, tool_calls(given, tool_parser=tool_parser) if task == "chat" else None)
    elif engine == "transformers" and task != "classify":
        GenerationParams.from_mapping(given)
