"""What every embedding engine shares: list inputs, and shortened (Matryoshka) embeddings.

A record of task ``embed`` holds one input (a text, or a token array: a list of the model's token ids)
or a list of inputs; an engine embeds inputs. `EmbeddingInputs` wraps any engine of that task: it
flattens the inputs of every record of a micro-batch into one call of the engine, so that a record of
many inputs batches as well as many records of one, then splits the embeddings back per record. A
record of one input keeps the engine's response unchanged; a record of a list gets
``{"embeddings": [one per input, in order], "usage": {"prompt_tokens": the sum}}``.

Param ``dimensions`` keeps the first that many values of each embedding and scales them back to unit
length, as OpenAI's Matryoshka models do. It is applied here, on the worker, for every engine alike:
the stored output is already short, and the native API's output and OpenAI's conversion read the same
vectors. The portal allows it only for models whose catalog entry declares Matryoshka training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpuworkers.batching import EngineOutputError
from gpuworkers.engines.base import Engine, is_token_array


class EmbeddingInputs:
    """An embedding engine that takes records of one input or a list of inputs, and ``dimensions``.

    Loading, memory and unloading are the wrapped engine's.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pads_to_longest = bool(getattr(engine, "pads_to_longest", False))

    def load(self, *, device: str) -> None:
        self.engine.load(device=device)

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        dimensions = _dimensions(params.get("dimensions"))
        texts = _flattened(inputs)
        responses = self.engine.run_batch(texts, params)
        if len(responses) != len(texts):
            # batching's own check would compare against the records, not the texts, and miss this.
            raise EngineOutputError(f"the engine returned {len(responses)} responses for {len(texts)} texts")
        if dimensions is not None:
            responses = [
                {**response, "embedding": shortened(_embedding(response), dimensions)} for response in responses
            ]
        grouped: list[dict[str, Any]] = []
        start = 0
        for value in inputs:
            if not _is_list_of_inputs(value):
                grouped.append(responses[start])
                start += 1
                continue
            own = responses[start : start + len(value)]
            start += len(value)
            tokens = sum(int(response["usage"]["prompt_tokens"]) for response in own)
            grouped.append(
                {"embeddings": [_embedding(response) for response in own], "usage": {"prompt_tokens": tokens}}
            )
        return grouped

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """Each record's first text over the model's limit, named by its place in the record's list."""
        check = getattr(self.engine, "too_long", None)
        if check is None:
            return [None] * len(inputs)
        messages = iter(check(_flattened(inputs), params))
        refused: list[str | None] = []
        for value in inputs:
            if not _is_list_of_inputs(value):
                refused.append(next(messages))
                continue
            own = [next(messages) for _ in value]
            first = next(((place, message) for place, message in enumerate(own) if message is not None), None)
            refused.append(None if first is None else f"input {first[0]} of the list: {first[1]}")
        return refused

    def memory_bytes(self) -> int:
        return self.engine.memory_bytes()

    def unload(self) -> None:
        self.engine.unload()


def _is_list_of_inputs(value: Any) -> bool:
    return isinstance(value, list) and not is_token_array(value)


def _flattened(inputs: Sequence[Any]) -> list[Any]:
    """The inputs of every record in order; a string, a token array or anything else the engine refuses by
    itself is one input."""
    flat: list[Any] = []
    for value in inputs:
        flat.extend(value if _is_list_of_inputs(value) else [value])
    return flat


def shortened(embedding: np.ndarray, dimensions: int) -> np.ndarray:
    """The first ``dimensions`` values of ``embedding``, scaled to unit L2 norm, as float32."""
    if dimensions > embedding.shape[-1]:
        raise ValueError(f"dimensions is {dimensions}, but the model's embeddings have {embedding.shape[-1]} values")
    prefix = np.asarray(embedding[:dimensions], dtype=np.float32)
    norm = float(np.linalg.norm(prefix))
    # A zero prefix has no direction to keep; it is returned as it is rather than divided into NaNs.
    return prefix / np.float32(norm) if norm > 0 else prefix


def _embedding(response: Mapping[str, Any]) -> np.ndarray:
    embedding = np.asarray(response.get("embedding"), dtype=np.float32)
    if embedding.ndim != 1 or embedding.size == 0:
        raise ValueError("the engine's response has no embedding (a list of numbers)")
    return embedding


def _dimensions(value: Any) -> int | None:
    # The portal checked it against the catalog; this guards a spec written by hand (bench, CLI on a host).
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"dimensions must be a positive whole number, not {value!r}")
    return value
