"""The `Engine` protocol and the registry that maps a catalog engine name to its class.

An engine is built once per worker process and model (see `gpuworkers.cache`), loaded on a device,
then fed micro-batches. Engines import torch, transformers or vllm lazily, inside `load`, so that
importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from gpuworkers.spec import ModelSpec

ADAPTER_PARAM = "adapter"
"""The run-time param that carries a record's LoRA adapter to the engine: the adapter's spec
(`gpuworkers.spec.AdapterSpec.to_dict`), or None for the base model alone. Only the slot sets it, from the
adapters its shard's message names; engines that serve adapters load each on first use and keep it."""


class EngineLoadError(Exception):
    """The model cannot be loaded (missing weights, bad config): permanent, retrying will not help."""


class Engine(Protocol):
    """Load once, run many batches, report memory, unload."""

    def load(self, *, device: str) -> None:
        """Load the model's weights onto ``device`` (``cpu``, ``cuda``, ``cuda:0``)."""

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run one micro-batch; return one response dict per input, in input order."""

    def memory_bytes(self) -> int:
        """Bytes the loaded model holds (parameters and buffers), for the cache's budget."""

    def unload(self) -> None:
        """Drop every reference to the model and free its memory."""


class LengthLimited(Protocol):
    """An engine that measures inputs against its model's limit, so `gpuworkers.batching` refuses
    the ones over it before they run instead of letting the model truncate or fail the micro-batch."""

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """For each input, what makes it too long for the model (its length and the limit), or None."""


class PadsToLongest(Protocol):
    """An engine whose forward passes pad every input to the longest of its batch (BERT-style encoders):
    it wastes less the closer in length the inputs it gets together, and `gpuworkers.batching` sorts a
    window of several micro-batches by length before cutting them when ``pads_to_longest`` is true."""

    pads_to_longest: bool


class SharesPrefixes(Protocol):
    """An engine that computes a prompt prefix shared by several inputs of a micro-batch once (the
    transformers engine's prefix reuse): `gpuworkers.batching` sorts a window of several micro-batches by
    their inputs' text, so that inputs sharing a prefix run together, when ``shares_prefixes(params)``."""

    def shares_prefixes(self, params: Mapping[str, Any]) -> bool:
        """Whether inputs run with ``params`` gain from sharing a micro-batch with those of the same prefix."""


class Submitted(Protocol):
    """A micro-batch's requests in an engine's queue (`Pipelined.submit_requests`)."""

    def result(self) -> list[dict[str, Any]]:
        """One response per input, in input order, once the engine has run them."""

    def cancel(self) -> None:
        """Take the requests out of the engine's queue: their results will not be asked for."""


class Answered:
    """`Submitted` for a micro-batch already run where it was submitted (an engine that cannot queue it)."""

    def __init__(self, responses: list[dict[str, Any]]) -> None:
        self._responses = responses

    def result(self) -> list[dict[str, Any]]:
        return self._responses

    def cancel(self) -> None:
        return None


@runtime_checkable
class Pipelined(Protocol):
    """An engine with a scheduler of its own that takes a micro-batch's requests while the one before still runs
    (vLLM's continuous batching): `gpuworkers.batching` submits the next micro-batch before it reads the results
    of the last, so that the engine's batch never drains between two micro-batches."""

    def submit_requests(self, inputs: Sequence[Any], params: Sequence[Mapping[str, Any]]) -> Submitted:
        """Queue these inputs, each with its own params, and return at once."""


@runtime_checkable
class HoldsAdapters(Protocol):
    """An engine that keeps LoRA adapters loaded beside its model: a slot's heartbeat reports them, so that
    the scheduler sends the shards of a job naming one to a slot that holds it (`portal.execution.adapter_routes`)."""

    def loaded_adapters(self) -> list[str]:
        """Fingerprints (`gpuworkers.spec.AdapterSpec.fingerprint`) of the adapters loaded now."""


@runtime_checkable
class SharesProcessState(Protocol):
    """An engine whose loaded model holds state its whole process shares with others of its kind, so that only one
    of them may be loaded in a process at a time (vLLM's CPU build: its engines' distributed state, which each
    one's shutdown tears down). The warm cache unloads the others of a kind before it loads one."""

    def process_state(self) -> str | None:
        """The kind of process-wide state this engine holds once loaded; None where it holds none."""


def over_limit(tokens: Sequence[int], limit: int | None, *, truncatable: bool = True) -> list[str | None]:
    """`LengthLimited.too_long`'s answer for inputs of these token counts against a limit (None: no limit)."""
    hint = " (truncate: true cuts it to fit)" if truncatable else ""
    return [
        f"the input has {count} tokens; the model takes at most {limit}{hint}"
        if limit is not None and count > limit
        else None
        for count in tokens
    ]


def json_kind(value: Any) -> str:
    """A parsed JSON value's type as JSON names it, for messages to the person who wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an empty array" if not value else "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def is_token_array(value: Any) -> bool:
    """A non-empty list of token ids (whole numbers, not booleans): one input of an embedding model, in
    the model's own vocabulary, as vLLM's OpenAI server takes them."""
    return isinstance(value, list) and bool(value) and all(type(item) is int for item in value)


def require_embedding_inputs(inputs: Sequence[Any], vocabulary: int) -> list[str | list[int]]:
    """An embedding micro-batch's inputs, each a non-empty text or a token array of ids under ``vocabulary``.

    No position in the messages: a failing micro-batch is run again record by record, and the message a
    record ends up with comes from a batch of one.
    """
    for item in inputs:
        if isinstance(item, str):
            if not item:
                raise ValueError("the input is an empty string")
        elif not is_token_array(item):
            raise ValueError(f"the input must be a string or an array of token ids, not {type(item).__name__}")
        elif (bad := next((token for token in item if not 0 <= token < vocabulary), None)) is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {vocabulary} ids")
    return list(inputs)


_ENGINES: dict[str, str] = {
    "python": "gpuworkers.engines.python:PythonEngine",
    "sentence_transformers": "gpuworkers.engines.sentence_transformers:SentenceTransformersEngine",
    "transformers": "gpuworkers.engines.transformers:TransformersEngine",
    "vllm": "gpuworkers.engines.vllm:VllmEngine",
}


_TASK_ENGINES: dict[tuple[str, str], str] = {
    ("transformers", "classify"): "gpuworkers.engines.classifier:SequenceClassifierEngine",
}
"""An engine's class for one task, where that task needs another kind of model (a classification head)."""


def create_engine(spec: ModelSpec) -> Engine:
    """Build (not load) the engine a catalog entry names, for its task."""
    try:
        target = _TASK_ENGINES.get((spec.engine, spec.task)) or _ENGINES[spec.engine]
    except KeyError:
        raise EngineLoadError(f"unknown engine {spec.engine!r}; known: {', '.join(sorted(_ENGINES))}") from None
    module_name, _, class_name = target.partition(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    engine: Engine = engine_class(spec)
    return engine
