"""Stand-ins for the vllm engine's tests: a catalog spec for a vllm model, a tool the tests share, and objects
with the attributes of vLLM's outputs (vllm/outputs.py, vllm/logprobs.py), for the engine's pure functions and a
stand-in ``vllm``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpuworkers.spec import ModelSpec

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            },
        },
    }
]
"""One tool whose call is short (a city of at most 8 characters): a tiny model's held reply fits its max_tokens."""


def vllm_spec(source: Path | str, **changes: object) -> ModelSpec:
    fields: dict[str, object] = {
        "name": "tiny-gpt2",
        "version": "1",
        "engine": "vllm",
        "task": "generate",
        "source": str(source),
    }
    return ModelSpec(**{**fields, **changes})  # type: ignore[arg-type]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = "length"
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    """The stop string (or stop token id) that ended the sample, as vLLM's."""


@dataclass
class RequestOutput:
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
