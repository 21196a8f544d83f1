"""vLLM's outputs as the responses a record gets: a completion (its samples, usage, cached prompt tokens and
logprobs, as OpenAI shapes them) and an embedding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def completion_response(output: Any, *, top_logprobs: int | None = None, copies: int = 1) -> dict[str, Any]:
    """The response for one prompt from vLLM's ``RequestOutput`` (``prompt_token_ids``, ``outputs``).

    The first sample is the response's ``text`` and ``finish_reason``; with more than one, every sample
    is in ``choices`` too, and ``completion_tokens`` counts the tokens of all of them, as OpenAI does.
    ``top_logprobs``, the number of alternatives asked per token, adds ``logprobs`` to each sample.
    ``copies`` > 1: a greedy request's one sample stands for that many (`sampling.greedy_copies`).
    """
    samples = list(output.outputs)
    if not samples:
        raise ValueError("vllm returned no completion for the prompt")
    samples = samples * copies
    choices = [{**_choice(sample, top_logprobs), "index": index} for index, sample in enumerate(samples)]
    response = dict(choices[0])
    del response["index"]
    response["usage"] = {
        "prompt_tokens": len(output.prompt_token_ids or ()),
        "completion_tokens": sum(len(sample.token_ids) for sample in samples),
    }
    cached = getattr(output, "num_cached_tokens", None)
    if cached is not None:
        # OpenAI's shape; a vLLM that does not count them (before V1) reports nothing rather than a zero.
        response["usage"]["prompt_tokens_details"] = {"cached_tokens": int(cached)}
    if len(choices) > 1:
        response["choices"] = choices
    return response


def embedding_response(output: Any) -> dict[str, Any]:
    """The response for one input from vLLM's ``EmbeddingRequestOutput`` (``prompt_token_ids``,
    ``outputs.embedding``)."""
    # float32 ndarray, as the sentence_transformers engine gives: orjson writes it directly and compactly.
    return {
        "embedding": np.asarray(output.outputs.embedding, dtype=np.float32),
        "usage": {"prompt_tokens": len(output.prompt_token_ids or ())},
    }


def _choice(sample: Any, top_logprobs: int | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": sample.index, "text": sample.text, "finish_reason": sample.finish_reason}
    # vLLM's `stop_reason`: the stop string that ended the sample (a token id for a stop token, None at EOS).
    if isinstance(sample.stop_reason, str):
        choice["stop_sequence"] = sample.stop_reason
    if top_logprobs is not None and sample.logprobs is not None:
        choice["logprobs"] = {"content": _logprob_content(sample.token_ids, sample.logprobs, top_logprobs)}
    return choice


def _logprob_content(token_ids: Sequence[int], positions: Sequence[Any], top: int) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content``: per generated token, its logprob and the ``top`` likeliest tokens.

    Each position of vLLM's logprobs maps token ids to ``Logprob`` (``logprob``, ``decoded_token``), for
    the sampled token and the top alternatives.
    """
    content = []
    # Not strict: a stop string can cut the text, never the token lists, but a length mismatch is not
    # worth failing a finished record over.
    for token_id, position in zip(token_ids, positions, strict=False):
        entries = dict(position or {})
        chosen = entries.get(token_id)
        likeliest = sorted(entries.values(), key=lambda entry: entry.logprob, reverse=True)[:top]
        content.append(
            {
                "token": _token_text(chosen),
                "logprob": None if chosen is None else float(chosen.logprob),
                "top_logprobs": [{"token": _token_text(entry), "logprob": float(entry.logprob)} for entry in likeliest],
            }
        )
    return content


def _token_text(entry: Any) -> str:
    text = None if entry is None else entry.decoded_token
    return text if isinstance(text, str) else ""
