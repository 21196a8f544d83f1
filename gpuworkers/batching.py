"""The micro-batch loop of a shard: records through an engine, a bad record isolated from the others.

A micro-batch that raises is run again record by record, so that only the records that fail get an
error result and all the others still get their response. Running out of memory is not a bad
record: `MemoryError` and torch's `OutOfMemoryError` propagate for the caller to handle.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuworkers.engines.base import Engine

logger = logging.getLogger(__name__)

ERROR_MESSAGE_LIMIT = 500
"""Characters of an exception's text kept in a record's error message."""


@dataclass(frozen=True)
class RecordResult:
    """The outcome of one input record: exactly one of ``response`` and ``error`` is set."""

    custom_id: str
    """The record's identity, carried from input to output."""
    response: dict[str, Any] | None
    """The engine's response for the record, or None when it failed."""
    error: dict[str, Any] | None
    """``{"code": "engine_error", "message": "ValueError: ..."}`` when the record failed, else None."""


class EngineOutputError(Exception):
    """The engine broke its contract: not one response dict per input."""


def run_records(
    engine: Engine,
    items: Sequence[tuple[str, Any]],
    *,
    params: Mapping[str, Any],
    micro_batch_size: int,
    on_progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[RecordResult]:
    """Run ``(custom_id, input)`` items through ``engine`` in micro-batches; yield results in input order.

    After each micro-batch's results are yielded, ``on_progress(records_done, errors)`` is called
    with running totals. ``should_stop()`` is asked before each micro-batch; when it answers True
    the iterator ends, and cancelling is the caller's business.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, not {micro_batch_size}")
    done = errors = 0
    for start in range(0, len(items), micro_batch_size):
        if should_stop is not None and should_stop():
            return
        results = _run_micro_batch(engine, items[start : start + micro_batch_size], params)
        yield from results
        done += len(results)
        errors += sum(result.error is not None for result in results)
        if on_progress is not None:
            on_progress(done, errors)


def _run_micro_batch(engine: Engine, items: Sequence[tuple[str, Any]], params: Mapping[str, Any]) -> list[RecordResult]:
    try:
        responses = _checked_run(engine, [value for _, value in items], params)
    except Exception as exc:
        if _is_out_of_memory(exc):
            raise
        if len(items) == 1:
            return [_failed(items[0][0], exc)]
        logger.warning(
            "a micro-batch of %d records failed (%s: %s); running it again record by record",
            len(items),
            type(exc).__name__,
            exc,
        )
        return [_run_one(engine, custom_id, value, params) for custom_id, value in items]
    return [RecordResult(custom_id, response, None) for (custom_id, _), response in zip(items, responses, strict=True)]


def _run_one(engine: Engine, custom_id: str, value: Any, params: Mapping[str, Any]) -> RecordResult:
    try:
        (response,) = _checked_run(engine, [value], params)
    except Exception as exc:
        if _is_out_of_memory(exc):
            raise
        return _failed(custom_id, exc)
    return RecordResult(custom_id, response, None)


def _checked_run(engine: Engine, inputs: list[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
    responses = engine.run_batch(inputs, params)
    if len(responses) != len(inputs):
        raise EngineOutputError(f"the engine returned {len(responses)} responses for {len(inputs)} inputs")
    for response in responses:
        if not isinstance(response, dict):
            raise EngineOutputError(f"the engine returned a {type(response).__name__}, not a dict")
    return responses


def _failed(custom_id: str, exc: Exception) -> RecordResult:
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > ERROR_MESSAGE_LIMIT:
        message = message[: ERROR_MESSAGE_LIMIT - 1] + "…"
    return RecordResult(custom_id, None, {"code": "engine_error", "message": message})


def _is_out_of_memory(exc: Exception) -> bool:
    if isinstance(exc, MemoryError):
        return True
    # Only an engine that imported torch can raise torch's error, so there is no need to import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)
