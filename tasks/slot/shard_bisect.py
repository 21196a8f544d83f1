"""Checkpointed runs that find the records killing a worker ("poison records").

After a shard has killed its worker a few times, the next attempts run it range by range. Before
each range the attempt writes `inflight.json`; after it, the range's output lines. A worker that
dies leaves its range in flight, so the next attempt keeps every finished range, halves the one
that killed the worker, and goes on. A range of one record that kills the worker again is given up
as a `poison_record` error; so is any range still in flight once the attempt cap is reached. Each
poison record costs about log2(micro-batch size) extra attempts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

from gpuworkers.batching import Items, RecordResult, run_records
from gpuworkers.engines import Engine
from tasks.shared.storage import ObjectStore, StorageError, join_uri
from tasks.slot.record_adapters import named_models

logger = logging.getLogger(__name__)

Range = tuple[int, int]


def _range_uri(prefix: str, span: Range) -> str:
    return join_uri(prefix, "ranges", f"{span[0]:08d}-{span[1]:08d}.jsonl")


def _finished_ranges(store: ObjectStore, prefix: str) -> list[Range]:
    spans = []
    for uri in store.list_prefix(join_uri(prefix, "ranges")):
        name = uri.rsplit("/", 1)[-1].removesuffix(".jsonl")
        start, _, end = name.partition("-")
        spans.append((int(start), int(end)))
    return sorted(spans)


def _range_in_flight(store: ObjectStore, prefix: str) -> Range | None:
    uri = join_uri(prefix, "inflight.json")
    try:
        data = orjson.loads(store.read_bytes(uri))
    except StorageError:
        return None
    return int(data["start"]), int(data["end"])


def _gaps(total: int, finished: list[Range]) -> list[Range]:
    gaps, position = [], 0
    for start, end in finished:
        if start > position:
            gaps.append((position, start))
        position = max(position, end)
    if position < total:
        gaps.append((position, total))
    return gaps


def plan_ranges(
    total: int, finished: list[Range], crashed: Range | None, chunk: int
) -> tuple[list[Range], Range | None]:
    """The ranges still to run, and the single-record range to give up as poison (if any)."""
    poison = None
    work: list[Range] = []
    for start, end in _gaps(total, finished):
        if crashed is not None and start <= crashed[0] and crashed[1] <= end:
            work.extend((s, min(s + chunk, crashed[0])) for s in range(start, crashed[0], chunk))
            if crashed[1] - crashed[0] == 1:
                poison = crashed
            else:
                middle = (crashed[0] + crashed[1]) // 2
                work.extend([(crashed[0], middle), (middle, crashed[1])])
            work.extend((s, min(s + chunk, end)) for s in range(crashed[1], end, chunk))
        else:
            work.extend((s, min(s + chunk, end)) for s in range(start, end, chunk))
    return work, poison


def _line(result: RecordResult) -> bytes:
    body: dict[str, Any] = {"custom_id": result.custom_id}
    body.update({"error": result.error} if result.error is not None else {"response": result.response})
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


def _poison_lines(items: Items, span: Range, attempts: int) -> bytes:
    error = {
        "code": "poison_record",
        "message": f"the record killed its worker process; isolated after {attempts} attempts of its shard",
    }
    return b"".join(
        orjson.dumps({"custom_id": custom_id, "error": error}, option=orjson.OPT_APPEND_NEWLINE)
        for custom_id, *_ in items[span[0] : span[1]]
    )


def run_checkpointed(
    *,
    store: ObjectStore,
    prefix: str,
    engine: Engine,
    items: Items,
    params: dict[str, Any],
    chunk: int,
    attempt_no: int,
    give_up_in_flight: bool,
    should_stop: Callable[[], bool],
    adapter_keys: Mapping[str, str],
    propagate: tuple[type[BaseException], ...] = (),
) -> Iterator[bytes] | None:
    """Run what is left of the shard; return its output lines in order, or None if told to stop. A record
    that ran with an adapter answers naming it, as on the plain path (`record_adapters.named_models`)."""
    finished = _finished_ranges(store, prefix)
    crashed = _range_in_flight(store, prefix)
    if crashed in finished:
        crashed = None
    if crashed is not None and give_up_in_flight:
        store.put_if_absent(_range_uri(prefix, crashed), _poison_lines(items, crashed, attempt_no))
        crashed = None
    work, poison = plan_ranges(len(items), finished, crashed, chunk)
    if poison is not None:
        logger.warning("shard %s: record %d killed its worker; giving it up as poison", prefix, poison[0])
        store.put_if_absent(_range_uri(prefix, poison), _poison_lines(items, poison, attempt_no))
    for span in work:
        if should_stop():
            return None
        with store.open_write(join_uri(prefix, "inflight.json")) as marker:
            marker.write(orjson.dumps({"start": span[0], "end": span[1]}))
        results = named_models(
            run_records(
                engine, items[span[0] : span[1]], params=params, micro_batch_size=span[1] - span[0], propagate=propagate
            ),
            adapter_keys,
        )
        with store.open_write(_range_uri(prefix, span)) as output:
            for result in results:
                output.write(_line(result))
    return _assembled(store, prefix)


def _assembled(store: ObjectStore, prefix: str) -> Iterator[bytes]:
    for span in _finished_ranges(store, prefix):
        with store.open_read(_range_uri(prefix, span)) as source:
            yield from source
