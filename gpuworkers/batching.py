"""The micro-batch loop of a shard: records through an engine, a bad record isolated from the others.

A micro-batch that raises is run again record by record, so that only the records that fail get an
error result (code ``engine_error``) and all the others still get their response. A micro-batch that
runs out of memory (`MemoryError`, torch's `OutOfMemoryError`) is split in halves after the cache is
freed, down to single records; a record that runs out of memory alone gets code ``out_of_memory``.
A CUDA error that breaks the device's context is no record's fault: `StickyDeviceError` is raised.

A record may carry params of its own over the job's (`Item.params`). A micro-batch whose records all run
with the job's params is one engine call. Otherwise an engine that takes params per input (`run_requests`,
as vLLM takes one ``SamplingParams`` a prompt) still gets the whole micro-batch in one call, and any other
engine gets one call per distinct set of params, the answers put back in input order.

An engine that knows how long an input its model takes (`LengthLimited`) has each micro-batch's records
measured first: one over the limit gets code ``input_too_long`` with its length and the limit, without
running, unless its params say ``truncate: true`` (the engine then cuts it to fit). A record refused before it
reached the slot (`Item.refused`) does not run either: it gets code ``invalid_request`` with the refusal.
"""

from __future__ import annotations

import gc
import logging
import re
import sys
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from gpuworkers.engines.base import Engine, Pipelined, Submitted
from gpuworkers.faults import StickyDeviceError, is_sticky_device_error, raised_from

logger = logging.getLogger(__name__)

ERROR_MESSAGE_LIMIT = 500
"""Characters of an exception's text kept in a record's error message."""

ENGINE_ERROR = "engine_error"
"""Error code of a record the engine raised on when it ran alone."""

OUT_OF_MEMORY = "out_of_memory"
"""Error code of a record that ran out of memory alone, after its micro-batch was split down to it."""

LENGTH_SORT_WINDOW = 4
"""Micro-batches of records sorted together: by length for an engine that pads to the longest input of a
batch (`PadsToLongest`), so that a batch's padding is small; by text for one that computes a shared prompt
prefix once (`SharesPrefixes`), so that records of one prefix run together. The window's results come out
when all of it ran, in input order, so a larger one would hold back writing and the shard's end for little
more saved."""

INPUT_TOO_LONG = "input_too_long"
"""Error code of a record longer than its model takes, refused before it runs unless its params say
``truncate: true``."""

INVALID_REQUEST = "invalid_request"
"""Error code of a record refused before it reached the slot (`Item.refused`): its request was at fault."""


@dataclass(frozen=True)
class RecordResult:
    """The outcome of one input record: exactly one of ``response`` and ``error`` is set."""

    custom_id: str
    """The record's identity, carried from input to output."""
    response: dict[str, Any] | None
    """The engine's response for the record, or None when it failed."""
    error: dict[str, Any] | None
    """``{"code": "engine_error", "message": "ValueError: ..."}`` when it failed (or ``out_of_memory``,
    ``input_too_long``, ``invalid_request``), else None."""


class EngineOutputError(Exception):
    """The engine broke its contract: not one response dict per input."""


@dataclass(frozen=True)
class _Failure:
    """A failed engine call, kept as text so that nothing of the failed batch outlives it."""

    code: str
    """``engine_error`` or ``out_of_memory``."""
    message: str
    """The exception's type and text, truncated to `ERROR_MESSAGE_LIMIT`."""


class Item(NamedTuple):
    """One record to run."""

    custom_id: str
    value: Any
    """The record's input (its task's input field)."""
    params: Mapping[str, Any] | None = None
    """The record's own params over the job's; a field set to null falls back to the engine's default."""
    refused: str | None = None
    """Why the request the record stands for cannot run, where it was refused at submission: the record does
    not run (its ``value`` is None) and its result is the error ``invalid_request`` with this message."""


Items = Sequence[Item | tuple[str, Any]]
"""Records to run: `Item`s, or ``(custom_id, value)`` pairs that run with the job's params alone."""

SubmitRequests = Callable[[Sequence[Any], Sequence[Mapping[str, Any]]], Submitted]
"""`Pipelined.submit_requests`."""


def merged_params(job: Mapping[str, Any], own: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A record's params: the job's, overridden by the record's own; a null leaves the field out."""
    if not own:
        return job
    return {name: value for name, value in {**job, **own}.items() if value is not None}


def run_records(
    engine: Engine,
    items: Items,
    *,
    params: Mapping[str, Any],
    micro_batch_size: int,
    on_progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_out_of_memory_split: Callable[[int], None] | None = None,
    on_micro_batch: Callable[[int], None] | None = None,
    propagate: tuple[type[BaseException], ...] = (),
) -> Iterator[RecordResult]:
    """Run ``(custom_id, input)`` items through ``engine`` in micro-batches; yield results in input order.

    An engine that pads to the longest input of a batch (`PadsToLongest`) gets each window of
    `LENGTH_SORT_WINDOW` micro-batches sorted by input length before it is cut, one that shares prompt
    prefixes (`SharesPrefixes`) each window sorted by input text, and that window's results come out, in
    input order, when all of it ran; any other engine gets the micro-batches in input order,
    each one's results out as soon as it ran. After each micro-batch, ``on_progress(records_done, errors)``
    is called with running totals. ``should_stop()`` is asked before each micro-batch but the first
    (the caller has just decided to start: asking again would cost a short shard a Redis and a storage
    read); when it answers True the iterator ends, and cancelling is the caller's business.
    ``on_out_of_memory_split(records)`` is called each time a batch of that many records ran out of
    memory and is split in halves, and ``on_micro_batch(records)`` with the size of each micro-batch
    before it runs.
    Exceptions of the ``propagate`` types are not a record's fault (e.g. the task's soft time
    limit): they end the run instead of being isolated.

    Raises `StickyDeviceError`, chained to the engine's error, when the device's context broke; the
    results yielded before it stand, the rest of the items (the window's too) are not run.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, not {micro_batch_size}")
    sort_key = _window_sort_key(engine, params)
    if sort_key is None and isinstance(engine, Pipelined):
        yield from _run_pipelined(
            engine,
            engine.submit_requests,
            items,
            params=params,
            micro_batch_size=micro_batch_size,
            on_progress=on_progress,
            should_stop=should_stop,
            on_out_of_memory_split=on_out_of_memory_split,
            on_micro_batch=on_micro_batch,
            propagate=propagate,
        )
        return
    sorting = sort_key is not None
    window = micro_batch_size * (LENGTH_SORT_WINDOW if sorting else 1)
    done = errors = 0
    for window_start in range(0, len(items), window):
        span = items[window_start : window_start + window]
        order = None if sort_key is None else sorted(range(len(span)), key=lambda index: sort_key(span[index][1]))
        ordered = span if order is None else [span[index] for index in order]
        ran: list[RecordResult] = []
        for start in range(0, len(ordered), micro_batch_size):
            if should_stop is not None and (window_start or start) and should_stop():
                return
            batch = ordered[start : start + micro_batch_size]
            if on_micro_batch is not None:
                on_micro_batch(len(batch))
            results = _run_within_limits(engine, batch, params, on_out_of_memory_split, propagate)
            if order is None:
                yield from results
            else:
                ran.extend(results)
            done += len(results)
            errors += sum(result.error is not None for result in results)
            if on_progress is not None:
                on_progress(done, errors)
        if order is not None:
            restored: list[RecordResult] = [ran[0]] * len(ran)
            for position, index in enumerate(order):
                restored[index] = ran[position]
            yield from restored


def _run_pipelined(
    engine: Engine,
    submit: SubmitRequests,
    items: Items,
    *,
    params: Mapping[str, Any],
    micro_batch_size: int,
    on_progress: Callable[[int, int], None] | None,
    should_stop: Callable[[], bool] | None,
    on_out_of_memory_split: Callable[[int], None] | None,
    on_micro_batch: Callable[[int], None] | None,
    propagate: tuple[type[BaseException], ...],
) -> Iterator[RecordResult]:
    """`run_records` for a `Pipelined` engine: each micro-batch is submitted before the results of the one before
    are read, so the engine's queue holds the next micro-batch's requests while the last one's finish. A
    micro-batch whose submission or results fail is run again as `_run_within_limits` runs one, its records
    isolated. The micro-batch submitted ahead is taken back out of the engine when the run ends early."""
    batches = [items[start : start + micro_batch_size] for start in range(0, len(items), micro_batch_size)]
    if not batches:
        return
    done = errors = 0
    # Submitted and not read yet: what is still in the engine's queue if the run ends here.
    pending = deque([_submit(engine, submit, batches[0], params, on_micro_batch, propagate)])
    try:
        for index in range(len(batches)):
            if index + 1 < len(batches) and not (should_stop is not None and should_stop()):
                pending.append(_submit(engine, submit, batches[index + 1], params, on_micro_batch, propagate))
            results = pending[0].results(engine, params, on_out_of_memory_split, propagate)
            pending.popleft()
            yield from results
            done += len(results)
            errors += sum(result.error is not None for result in results)
            if on_progress is not None:
                on_progress(done, errors)
            if not pending:
                return
    finally:
        for submission in pending:
            submission.cancel()


@dataclass
class _Submission:
    """A micro-batch submitted to a `Pipelined` engine: its records refused before running, by index, and the
    engine's handle on the others (None where submitting failed: they run again when their results are read)."""

    items: Items
    refused: dict[int, dict[str, str]]
    fitting: Items
    submitted: Submitted | None

    def results(
        self,
        engine: Engine,
        params: Mapping[str, Any],
        on_split: Callable[[int], None] | None,
        propagate: tuple[type[BaseException], ...],
    ) -> list[RecordResult]:
        ran: list[RecordResult] = []
        if self.fitting:
            outcome: list[dict[str, Any]] | _Failure | None = None
            submitted = self.submitted
            if submitted is not None:
                outcome = _guarded(lambda: _checked(submitted.result(), len(self.fitting)), propagate)
            ran = _run_micro_batch(engine, self.fitting, params, on_split, propagate, outcome=outcome)
        answered = iter(ran)
        return [
            RecordResult(item[0], None, self.refused[index]) if index in self.refused else next(answered)
            for index, item in enumerate(self.items)
        ]

    def cancel(self) -> None:
        if self.submitted is not None:
            self.submitted.cancel()


def _submit(
    engine: Engine,
    submit: SubmitRequests,
    items: Items,
    params: Mapping[str, Any],
    on_micro_batch: Callable[[int], None] | None,
    propagate: tuple[type[BaseException], ...],
) -> _Submission:
    if on_micro_batch is not None:
        on_micro_batch(len(items))
    refused = _refused(engine, items, params)
    fitting = [item for index, item in enumerate(items) if index not in refused]
    submitted = None
    if fitting:
        own = [merged_params(params, item[2] if len(item) > 2 else None) for item in fitting]
        try:
            submitted = submit([item[1] for item in fitting], own)
        except Exception as exc:
            # Its records run again one by one when its results are read: the error is a record's, or the device's.
            if raised_from(exc, propagate):
                raise
            if is_sticky_device_error(exc):
                raise StickyDeviceError(f"the device's context is broken: {_describe(exc)}") from exc
    return _Submission(items=items, refused=refused, fitting=fitting, submitted=submitted)


def _window_sort_key(engine: Engine, params: Mapping[str, Any]) -> Callable[[Any], Any] | None:
    """How a window of records is ordered before it is cut into micro-batches, if it is."""
    if getattr(engine, "pads_to_longest", False):
        return _length
    shares_prefixes = getattr(engine, "shares_prefixes", None)
    if shares_prefixes is not None and shares_prefixes(params):
        return _text
    return None


def _text(value: Any) -> str:
    """An input as text whose order puts inputs of a common prefix side by side: a prompt itself, a chat's
    messages as JSON (a system prompt first, then the turns)."""
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _length(value: Any) -> int:
    """How long an input is, as far as padding goes: characters of a text (a cheap stand-in for its
    tokens), the tokens of a token array, the sum over a list of texts."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(item) if isinstance(item, str) else 1 for item in value)
    return 0


def _run_within_limits(
    engine: Engine,
    items: Items,
    params: Mapping[str, Any],
    on_split: Callable[[int], None] | None,
    propagate: tuple[type[BaseException], ...],
) -> list[RecordResult]:
    """Refuse the records refused at submission and those longer than the model takes, each with its own error,
    and run the others."""
    refused = _refused(engine, items, params)
    if not refused:
        return _run_micro_batch(engine, items, params, on_split, propagate)
    fitting = [item for index, item in enumerate(items) if index not in refused]
    ran = iter(_run_micro_batch(engine, fitting, params, on_split, propagate) if fitting else [])
    return [
        RecordResult(item[0], None, refused[index]) if index in refused else next(ran)
        for index, item in enumerate(items)
    ]


def _refused(engine: Any, items: Items, params: Mapping[str, Any]) -> dict[int, dict[str, str]]:
    """The records that do not run, by index, each with its error: refused at submission, or too long."""
    refused = {
        index: {"code": INVALID_REQUEST, "message": item[3]}
        for index, item in enumerate(items)
        if len(item) > 3 and item[3] is not None
    }
    # A refused record has no input to measure.
    for index, message in _too_long(engine, items, params, skip=refused).items():
        refused[index] = {"code": INPUT_TOO_LONG, "message": message}
    return refused


def _too_long(engine: Any, items: Items, params: Mapping[str, Any], skip: Collection[int]) -> dict[int, str]:
    """The items over the model's limit, by index, each with its message; those at `skip` are not measured."""
    # Checked before the engine runs: a model silently truncating the record, or one failing the whole
    # micro-batch over it, would both be wrong (the first changes the answer, the second costs a bisection).
    check = getattr(engine, "too_long", None)
    if check is None:
        return {}
    too_long: dict[int, str] = {}
    for record_params, indices in _by_params(items, params):
        if skip:
            indices = [index for index in indices if index not in skip]
        if not indices or record_params.get("truncate") is True:
            continue
        try:
            messages = check([items[index][1] for index in indices], record_params)
        except Exception:
            # An input or param the engine cannot even measure fails the run, record by record, with its
            # own message; measuring is not the place to judge it.
            continue
        for index, message in zip(indices, messages, strict=True):
            if message is not None:
                too_long[index] = message
    return too_long


def _by_params(items: Items, params: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], list[int]]]:
    """The items' indices grouped by the params each record runs with (the job's, merged with its own)."""
    own = [item[2] if len(item) > 2 else None for item in items]
    if not any(own):
        return [(params, list(range(len(items))))]
    groups: dict[bytes, tuple[Mapping[str, Any], list[int]]] = {}
    for index, record_params in enumerate(own):
        merged = merged_params(params, record_params)
        key = orjson.dumps(merged, option=orjson.OPT_SORT_KEYS)
        groups.setdefault(key, (merged, []))[1].append(index)
    return list(groups.values())


def _run_micro_batch(
    engine: Engine,
    items: Items,
    params: Mapping[str, Any],
    on_split: Callable[[int], None] | None,
    propagate: tuple[type[BaseException], ...] = (),
    *,
    outcome: list[dict[str, Any]] | _Failure | None = None,
) -> list[RecordResult]:
    """Run the records, isolating those that fail; `outcome`, where given, is this very run's, already made."""
    if outcome is None:
        outcome = _attempt(engine, items, params, propagate)
    if not isinstance(outcome, _Failure):
        return [RecordResult(item[0], response, None) for item, response in zip(items, outcome, strict=True)]
    if outcome.code == OUT_OF_MEMORY:
        free_device_memory()
    if len(items) == 1:
        return [_failed(items[0][0], outcome)]
    if outcome.code == OUT_OF_MEMORY:
        # Halving bounds the recursion at log2(len(items)) levels and 2 * len(items) - 1 engine calls.
        middle = len(items) // 2
        logger.warning(
            "a micro-batch of %d records ran out of memory (%s); running it again as %d and %d records",
            len(items),
            outcome.message,
            middle,
            len(items) - middle,
        )
        if on_split is not None:
            on_split(len(items))
        first_half = _run_micro_batch(engine, items[:middle], params, on_split, propagate)
        return first_half + _run_micro_batch(engine, items[middle:], params, on_split, propagate)
    logger.warning(
        "a micro-batch of %d records failed (%s); running it again record by record", len(items), outcome.message
    )
    return [result for item in items for result in _run_micro_batch(engine, [item], params, on_split, propagate)]


def _attempt(
    engine: Engine, items: Items, params: Mapping[str, Any], propagate: tuple[type[BaseException], ...] = ()
) -> list[dict[str, Any]] | _Failure:
    return _guarded(lambda: _checked_run(engine, items, params), propagate)


def _guarded(
    run: Callable[[], list[dict[str, Any]]], propagate: tuple[type[BaseException], ...]
) -> list[dict[str, Any]] | _Failure:
    """``run()``'s responses, or its failure as a plain value."""
    # The exception is turned into a plain value before returning: its traceback holds the engine's
    # frames and, through them, the tensors of the failed batch, which must be gone before a retry.
    try:
        return run()
    except Exception as exc:
        if raised_from(exc, propagate):
            raise
        if is_sticky_device_error(exc):
            raise StickyDeviceError(f"the device's context is broken: {_describe(exc)}") from exc
        return _Failure(OUT_OF_MEMORY if _is_out_of_memory(exc) else ENGINE_ERROR, _describe(exc))


def _checked_run(engine: Engine, items: Items, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    inputs = [item[1] for item in items]
    own = [item[2] if len(item) > 2 else None for item in items]
    if not any(own):
        return _checked(engine.run_batch(inputs, params), len(inputs))
    run_requests = getattr(engine, "run_requests", None)
    if run_requests is not None:
        return _checked(run_requests(inputs, [merged_params(params, p) for p in own]), len(inputs))
    responses: list[dict[str, Any]] = [{} for _ in inputs]
    for group_params, indices in _by_params(items, params):
        answered = _checked(engine.run_batch([inputs[index] for index in indices], group_params), len(indices))
        for index, response in zip(indices, answered, strict=True):
            responses[index] = response
    return responses


def _checked(responses: list[dict[str, Any]], expected: int) -> list[dict[str, Any]]:
    if len(responses) != expected:
        raise EngineOutputError(f"the engine returned {len(responses)} responses for {expected} inputs")
    for response in responses:
        if not isinstance(response, dict):
            raise EngineOutputError(f"the engine returned a {type(response).__name__}, not a dict")
    return responses


def free_device_memory() -> None:
    """Collect garbage and hand torch's cached CUDA blocks back, so that a smaller retry can fit."""
    gc.collect()
    # Only CUDA this process already initialised has a cache to free; initialising it here would not.
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.empty_cache()
    except Exception as exc:
        if is_sticky_device_error(exc):
            raise StickyDeviceError(f"the device's context is broken: {_describe(exc)}") from exc
        raise


def _describe(exc: Exception) -> str:
    message = f"{type(exc).__name__}: {exc}"
    if len(message) > ERROR_MESSAGE_LIMIT:
        message = message[: ERROR_MESSAGE_LIMIT - 1] + "…"
    return message


_LOCATION = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"]+|(?<![\w.~-])(?:/[\w.@+~-]+){2,}/?")
"""A URI (``s3://…``, ``file://…``) or an absolute path of two segments or more, as an engine's exception
names the weights, cache or storage it was reading: the host's layout, never the tenant's to see."""


def redact_locations(message: str) -> str:
    """``message`` (an engine's exception, for a record's error line) with every location written ``<path>``."""
    return _LOCATION.sub("<path>", message)


def _failed(custom_id: str, failure: _Failure) -> RecordResult:
    # The tenant reads the message; the slot's log keeps it whole.
    return RecordResult(custom_id, None, {"code": failure.code, "message": redact_locations(failure.message)})


def _is_out_of_memory(exc: Exception) -> bool:
    if isinstance(exc, MemoryError):
        return True
    # Only an engine that imported torch can raise torch's error, so there is no need to import it here.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)
