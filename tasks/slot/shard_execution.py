"""Running one shard on a warm worker: the body of `run_shard`, kept free of Celery and Django.

Each attempt is counted by a marker in storage (which survives Redis and the worker), holds a lease
in Redis while it runs, and checks its job's stop flag on arrival and between micro-batches. It
writes its output under keys unique to it, then commits by creating the shard's commit marker if
it does not exist yet. A second attempt of a committed shard (a redelivered message) returns the
committed manifest and writes nothing, so the merge sees exactly one attempt per shard.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, nullcontext
from functools import partial
from types import TracebackType
from typing import Any, BinaryIO, NamedTuple

import orjson
from celery.exceptions import SoftTimeLimitExceeded

from gpuworkers import metrics
from gpuworkers.batching import Item, RecordResult, run_records
from gpuworkers.cache import process_cache
from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.embeddings import EmbeddingInputs
from gpuworkers.settings import device, micro_batch_size
from tasks.shared.config import SHARD_ATTEMPTS_BEFORE_BISECT, SHARD_MAX_ATTEMPTS
from tasks.shared.leases import Lease, shard_lease_key
from tasks.shared.progress import publish_shard_progress, shard_progress_commands
from tasks.shared.specs import ShardManifest, ShardSkipped, ShardSpec, read_commit, started_uri
from tasks.shared.stops import PAUSED, arrival_flags, stop_reason
from tasks.shared.storage import ObjectStore, join_uri, store_for
from tasks.slot import state as slot_state
from tasks.slot.provenance import pinned_weights_check, shard_provenance
from tasks.slot.record_adapters import AdapterTally, named_models, record_items
from tasks.slot.record_seeds import seeded_items
from tasks.slot.shard_bisect import run_checkpointed
from tasks.slot.shard_piece import ShardPiece

logger = logging.getLogger(__name__)

# Embeddings arrive as numpy arrays; orjson writes them without a detour through Python floats.
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
PROGRESS_INTERVAL_S = 0.1
"""A running shard publishes its live progress at most this often, first this long after it started,
and once at its end (with its lease's release): a person watching sees no difference, and a fast
model's micro-batches, or a short shard's one, do not each cost a Redis round trip."""


def start_attempt(store: ObjectStore, spec: ShardSpec, attempt_id: str, worker: str) -> int:
    """Record that an attempt started; return how many have started, this one included.

    The marker is the first free number under `started/` (`0001`, `0002`, ...), created exclusively, so
    two attempts racing each take their own and the number is the count. A shard's first attempt
    (nearly every one) makes one request and lists nothing; the listing it made was a tenth of a
    one-record shard's storage time here, and on S3 a LIST is ten times a PUT's price."""
    started = started_uri(spec.shard_prefix)
    holder = f"{worker}:{attempt_id}".encode()
    number = 1
    while not store.put_if_absent(join_uri(started, f"{number:04d}"), holder):
        number += 1
    return number


def _read_items(spec: ShardSpec) -> tuple[list[Item], dict[str, str]]:
    with store_for(spec.input_uri).open_read(spec.input_uri) as stream:
        return record_items(spec, map(orjson.loads, stream))


class OutputLine(NamedTuple):
    data: bytes
    error_code: str | None
    """The record's error code, None for a response."""
    prompt_tokens: int
    completion_tokens: int
    result: RecordResult | None = None
    """The record as the engine gave it (an embedding still its array), for the Parquet piece."""
    cached_prompt_tokens: int = 0
    """Of the prompt tokens, those a prefix cache served (usage's ``prompt_tokens_details.cached_tokens``)."""


def _output_line(result: RecordResult) -> bytes:
    if result.error is not None:
        return orjson.dumps({"custom_id": result.custom_id, "error": result.error}, option=_JSON_OPTIONS)
    return orjson.dumps({"custom_id": result.custom_id, "response": result.response}, option=_JSON_OPTIONS)


def execute_shard(spec: ShardSpec, *, worker: str) -> ShardManifest | ShardSkipped:
    attempts = metrics.SHARD_ATTEMPTS
    labels = metrics.model_labels(spec.model.name)
    committed = read_commit(spec.shard_prefix)
    if committed is not None:
        logger.info("shard %s/%d already committed by %s", spec.job_id, spec.shard_index, committed.attempt_id)
        attempts.labels(*labels, "duplicate").inc()
        return committed
    attempt_id = uuid.uuid4().hex
    # The job's stop and pause flags read, and the lease taken, in one round trip.
    lease = Lease(shard_lease_key(spec.job_id, spec.shard_index), f"{worker}:{attempt_id}")
    reason = lease.take_unless_flagged(arrival_flags(spec.job_id))
    if reason is not None:
        attempts.labels(*labels, "skipped").inc()
        return ShardSkipped(job_id=spec.job_id, shard_index=spec.shard_index, skipped=reason)

    store = store_for(spec.shard_prefix)
    slot_state.current_shard = f"{spec.job_id}/{spec.shard_index}"
    try:
        with lease:
            if spec.hold_uri and store_for(spec.hold_uri).exists(spec.hold_uri):
                # The Redis flag was lost (Redis restarted); the marker in storage was not.
                attempts.labels(*labels, "skipped").inc()
                return ShardSkipped(job_id=spec.job_id, shard_index=spec.shard_index, skipped=PAUSED)
            attempt_no = start_attempt(store, spec, attempt_id, worker)
            with metrics.slot_clock.busy():
                outcome = _run_attempt(
                    spec, store=store, worker=worker, attempt_id=attempt_id, attempt_no=attempt_no, lease=lease
                )
    except BaseException:
        attempts.labels(*labels, "error").inc()
        raise
    finally:
        slot_state.current_shard = None
    if isinstance(outcome, ShardSkipped):
        attempts.labels(*labels, "skipped").inc()
    elif outcome.attempt_id != attempt_id:
        attempts.labels(*labels, "lost_race").inc()
    else:
        attempts.labels(*labels, "committed").inc()
        metrics.SHARD_DURATION.labels(*labels).observe(outcome.finished_at - outcome.started_at)
    return outcome


def _run_attempt(
    spec: ShardSpec, *, store: ObjectStore, worker: str, attempt_id: str, attempt_no: int, lease: Lease
) -> ShardManifest | ShardSkipped:
    started_at = time.time()
    labels = metrics.model_labels(spec.model.name)
    cache = process_cache()
    lookup = cache.get(spec.model, device=device())
    # Every embedding engine takes lists of texts and `dimensions` the same way, through one wrapper.
    engine = EmbeddingInputs(lookup.engine) if spec.model.task == "embed" else lookup.engine
    items, adapter_keys = _read_items(spec)
    params = {name: value for name, value in spec.params.items() if name != ADAPTER_PARAM}
    pinned_weights_check(spec, lookup)
    provenance = shard_provenance(spec, lookup, items)
    items = seeded_items(spec, items, params)
    chunk = int(params.get("micro_batch_size", micro_batch_size(spec.model.engine)))

    def stopped() -> bool:
        # Cancelled or expired, or beaten: another attempt of this shard (a speculative copy of a
        # straggler, or the straggler itself) committed first, and this one's work can only be lost.
        return stop_reason(spec.job_id) is not None or store.exists(spec.commit_uri)

    # The first figures after PROGRESS_INTERVAL_S: a shorter shard writes only its totals, with its lease.
    published_at = time.monotonic()
    published: tuple[int, int] | None = None
    """The totals last written, so that the end does not write them again."""

    def on_progress(done: int, failed: int) -> None:
        nonlocal published_at, published
        now = time.monotonic()
        if now - published_at >= PROGRESS_INTERVAL_S:
            published_at = now
            if publish_shard_progress(spec.job_id, spec.shard_index, done=done, failed=failed):
                published = (done, failed)

    compute_started = time.perf_counter()
    lines: Iterable[OutputLine] | None
    if attempt_no > SHARD_ATTEMPTS_BEFORE_BISECT:
        logger.warning(
            "shard %s/%d: attempt %d, running range by range with checkpoints",
            spec.job_id,
            spec.shard_index,
            attempt_no,
        )
        checkpointed = run_checkpointed(
            store=store,
            prefix=join_uri(spec.shard_prefix, "bisect"),
            engine=engine,
            items=items,
            params=params,
            chunk=chunk,
            attempt_no=attempt_no,
            give_up_in_flight=attempt_no >= SHARD_MAX_ATTEMPTS,
            should_stop=stopped,
            adapter_keys=adapter_keys,
            propagate=(SoftTimeLimitExceeded,),
        )
        lines = None if checkpointed is None else _from_lines(checkpointed)
    else:
        results = run_records(
            engine,
            items,
            params=params,
            micro_batch_size=chunk,
            on_progress=on_progress,
            should_stop=stopped,
            on_out_of_memory_split=lambda _: metrics.OOM_SPLITS.labels(*labels).inc(),
            on_micro_batch=metrics.MICRO_BATCH_SIZE.labels(*labels).observe,
            propagate=(SoftTimeLimitExceeded,),
        )
        lines = _from_results(named_models(results, adapter_keys))
    if lines is None:
        return _abandoned(spec)

    attempt_prefix = join_uri(spec.shard_prefix, "attempts", attempt_id)
    output_uri = f"{attempt_prefix}.output.jsonl"
    errors_uri = f"{attempt_prefix}.errors.jsonl"
    piece = ShardPiece(store, f"{attempt_prefix}.output.parquet", task=spec.model.task)
    wanted = piece if spec.output_format == "parquet" else None
    tally = AdapterTally(adapter_keys)
    counts, error_codes = _write_outputs(
        store, tally.count(lines), output_uri=output_uri, errors_uri=errors_uri, piece=wanted
    )
    compute_seconds = time.perf_counter() - compute_started
    _count_work(labels, counts)
    if counts["records"] != spec.record_count:
        # Told to stop between micro-batches: the attempt is abandoned, not committed.
        store.delete_prefix(output_uri)
        store.delete_prefix(errors_uri)
        store.delete_prefix(piece.uri)
        return _abandoned(spec)
    if published != (counts["records"], counts["failed"]):
        # Sent with the lease's release, in the same round trip, moments after the commit below.
        lease.send_on_release(
            partial(
                shard_progress_commands,
                job_id=spec.job_id,
                shard_index=spec.shard_index,
                done=counts["records"],
                failed=counts["failed"],
            )
        )

    manifest = ShardManifest(
        job_id=spec.job_id,
        shard_index=spec.shard_index,
        attempt_id=attempt_id,
        worker=worker,
        pid=os.getpid(),
        output_uri=output_uri,
        errors_uri=errors_uri if counts["failed"] else "",
        parquet_uri=piece.uri if piece.written else "",
        records=counts["records"],
        succeeded=counts["records"] - counts["failed"],
        failed=counts["failed"],
        started_at=started_at,
        finished_at=time.time(),
        compute_seconds=round(compute_seconds, 4),
        load_seconds=round(lookup.load_seconds, 4),
        cache_hit=lookup.hit,
        model_loads=process_cache().loads_of(spec.model.cache_key),
        prompt_tokens=counts["prompt_tokens"],
        completion_tokens=counts["completion_tokens"],
        cached_prompt_tokens=counts["cached_prompt_tokens"],
        error_codes=dict(error_codes),
        adapter_usage=tally.usage,
        provenance=provenance,
    )
    if not store.put_if_absent(spec.commit_uri, orjson.dumps(manifest.to_dict())):
        # Another attempt committed first; ours is an orphan and the committed one stands.
        store.delete_prefix(output_uri)
        store.delete_prefix(errors_uri)
        store.delete_prefix(piece.uri)
        winner = read_commit(spec.shard_prefix)
        assert winner is not None
        return winner
    return manifest


def _abandoned(spec: ShardSpec) -> ShardManifest | ShardSkipped:
    """What an attempt that stopped early returns: the attempt that beat it, or why its job stopped."""
    winner = read_commit(spec.shard_prefix)
    if winner is not None:
        return winner
    return ShardSkipped(job_id=spec.job_id, shard_index=spec.shard_index, skipped=stop_reason(spec.job_id) or "")


def _count_work(labels: tuple[str, ...], counts: dict[str, int]) -> None:
    """The attempt's records and tokens, counted as work done whether or not the attempt commits."""
    metrics.SLOT_RECORDS.labels(*labels, "succeeded").inc(counts["records"] - counts["failed"])
    metrics.SLOT_RECORDS.labels(*labels, "failed").inc(counts["failed"])
    metrics.SLOT_TOKENS.labels(*labels, "prompt").inc(counts["prompt_tokens"])
    metrics.SLOT_TOKENS.labels(*labels, "completion").inc(counts["completion_tokens"])


def _from_results(results: Iterable[RecordResult]) -> Iterator[OutputLine]:
    for result in results:
        usage = (result.response or {}).get("usage") or {}
        yield OutputLine(
            _output_line(result),
            None if result.error is None else str(result.error.get("code", "error")),
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            result,
            cached_tokens(usage),
        )


def _from_lines(lines: Iterable[bytes]) -> Iterator[OutputLine]:
    for line in lines:
        record = orjson.loads(line)
        usage = (record.get("response") or {}).get("usage") or {}
        error_code = str((record["error"] or {}).get("code", "error")) if "error" in record else None
        result = RecordResult(record["custom_id"], record.get("response"), record.get("error"))
        tokens = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        yield OutputLine(line, error_code, *tokens, result, cached_tokens(usage))


def cached_tokens(usage: dict[str, Any]) -> int:
    """A response's prompt tokens served from a prefix cache (OpenAI's ``prompt_tokens_details``); 0 where
    its engine reports none."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _write_outputs(
    store: ObjectStore,
    lines: Iterable[OutputLine],
    *,
    output_uri: str,
    errors_uri: str,
    piece: ShardPiece | None = None,
) -> tuple[dict[str, int], Counter[str]]:
    """Write the attempt's output lines, its error lines if a record failed, and its Parquet `piece`
    if asked; return its counts and its error codes. No error lines, no error file: most shards have
    none, and an empty object cost each of them a write (an S3 PUT) and the merge a read.

    `lines` runs the model as it is consumed; the writes go to storage on a thread (`_BlockWriter`),
    so an S3 part upload does not hold up the next micro-batch.
    """
    counts = {"records": 0, "failed": 0, "prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0}
    error_codes: Counter[str] = Counter()
    with (
        store.open_write(output_uri) as output,
        ExitStack() as opened,
        _BlockWriter(output, lambda: opened.enter_context(store.open_write(errors_uri))) as writer,
        piece or nullcontext(),
    ):
        for line in lines:
            writer.add(line.data, error=line.error_code is not None)
            if piece is not None:
                piece.add(line.data, line.result)
            counts["records"] += 1
            counts["prompt_tokens"] += line.prompt_tokens
            counts["completion_tokens"] += line.completion_tokens
            counts["cached_prompt_tokens"] += line.cached_prompt_tokens
            if line.error_code is not None:
                counts["failed"] += 1
                error_codes[line.error_code] += 1
    return counts, error_codes


class _BlockWriter:
    """Gathers lines into blocks and writes each block on a thread while the caller goes on.

    At most `QUEUED_BLOCKS` blocks wait, so memory stays bounded when storage is slower than the
    model. A write that fails is raised in the caller at its next block or at the end; when the
    caller fails (a soft time limit, a broken device), the thread stops before the writers are
    abandoned, so nothing is written after the attempt gave up. The thread starts with the first
    full block: a shard whose output never fills one writes it at the end, in the caller, when the
    thread would have written it too (starting a thread costs a short shard more than its write).
    The error file is opened (`open_errors`) with the first error line that is written.
    """

    BLOCK_BYTES = 1024 * 1024
    QUEUED_BLOCKS = 8

    def __init__(self, output: BinaryIO, open_errors: Callable[[], BinaryIO]) -> None:
        self._target = output
        self._open_errors = open_errors
        self._errors_target: BinaryIO | None = None
        self._output = bytearray()
        self._errors = bytearray()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(maxsize=self.QUEUED_BLOCKS)
        self._failure: BaseException | None = None
        self._abandoned = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _BlockWriter:
        return self

    def add(self, data: bytes, *, error: bool) -> None:
        self._output += data
        if error:
            self._errors += data
        if len(self._output) >= self.BLOCK_BYTES:
            self._hand_off()

    def _hand_off(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="shard output writer", daemon=True)
            self._thread.start()
        self._queue.put((bytes(self._output), bytes(self._errors)))
        self._output.clear()
        self._errors.clear()

    def _write(self, output: bytes | bytearray, errors: bytes | bytearray) -> None:
        self._target.write(output)
        if errors:
            if self._errors_target is None:
                self._errors_target = self._open_errors()
            self._errors_target.write(errors)

    def _drain(self) -> None:
        while (block := self._queue.get()) is not None:
            if self._abandoned.is_set() or self._failure is not None:
                continue  # keep taking blocks, so a caller blocked on a full queue is let go
            try:
                self._write(*block)
            except BaseException as exc:  # handed to the caller, which raises it
                self._failure = exc

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is None:
            if exc is None:
                self._write(self._output, self._errors)
            return
        try:
            if exc is None:
                self._hand_off()
            else:
                self._abandoned.set()
        finally:
            self._queue.put(None)
            self._thread.join()
        if exc is None and self._failure is not None:
            raise self._failure
