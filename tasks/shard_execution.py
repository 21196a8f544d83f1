"""Running one shard on a warm worker: the body of `run_shard`, kept free of Celery and Django.

The attempt writes its output under keys unique to it, then commits by creating the shard's commit
marker if it does not exist yet. A second attempt of a committed shard (a redelivered message)
returns the committed manifest and writes nothing, so the merge sees exactly one attempt per shard.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson

from gpuworkers.batching import RecordResult, run_records
from gpuworkers.cache import process_cache
from gpuworkers.settings import device, micro_batch_size
from tasks.progress import publish_shard_progress
from tasks.specs import ShardManifest, ShardSpec
from tasks.storage import join_uri, store_for

logger = logging.getLogger(__name__)

# Embeddings arrive as numpy arrays; orjson writes them without a detour through Python floats.
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


def read_committed_manifest(spec: ShardSpec) -> ShardManifest | None:
    store = store_for(spec.commit_uri)
    if not store.exists(spec.commit_uri):
        return None
    return ShardManifest.from_dict(orjson.loads(store.read_bytes(spec.commit_uri)))


def _read_items(spec: ShardSpec) -> Iterator[tuple[str, Any]]:
    with store_for(spec.input_uri).open_read(spec.input_uri) as stream:
        for raw in stream:
            record = orjson.loads(raw)
            yield record["custom_id"], record[spec.input_field]


def _output_line(result: RecordResult) -> bytes:
    if result.error is not None:
        return orjson.dumps({"custom_id": result.custom_id, "error": result.error}, option=_JSON_OPTIONS)
    return orjson.dumps({"custom_id": result.custom_id, "response": result.response}, option=_JSON_OPTIONS)


def execute_shard(spec: ShardSpec, *, worker: str) -> ShardManifest:
    committed = read_committed_manifest(spec)
    if committed is not None:
        logger.info(
            "shard %s/%d already committed by %s; nothing to do", spec.job_id, spec.shard_index, committed.attempt_id
        )
        return committed

    started_at = time.time()
    attempt_id = uuid.uuid4().hex
    cache = process_cache()
    lookup = cache.get(spec.model, device=device())
    items = list(_read_items(spec))

    attempt_prefix = join_uri(spec.shard_prefix, "attempts", attempt_id)
    output_uri = f"{attempt_prefix}.output.jsonl"
    errors_uri = f"{attempt_prefix}.errors.jsonl"
    store = store_for(output_uri)

    def on_progress(done: int, failed: int) -> None:
        publish_shard_progress(spec.job_id, spec.shard_index, done=done, failed=failed)

    succeeded = failed = prompt_tokens = completion_tokens = 0
    compute_started = time.perf_counter()
    with store.open_write(output_uri) as output, store.open_write(errors_uri) as errors:
        results = run_records(
            lookup.engine,
            items,
            params=spec.params,
            micro_batch_size=int(spec.params.get("micro_batch_size", micro_batch_size())),
            on_progress=on_progress,
        )
        for result in results:
            line = _output_line(result)
            output.write(line)
            if result.error is not None:
                errors.write(line)
                failed += 1
                continue
            succeeded += 1
            usage = (result.response or {}).get("usage") or {}
            prompt_tokens += int(usage.get("prompt_tokens", 0))
            completion_tokens += int(usage.get("completion_tokens", 0))
    compute_seconds = time.perf_counter() - compute_started

    manifest = ShardManifest(
        job_id=spec.job_id,
        shard_index=spec.shard_index,
        attempt_id=attempt_id,
        worker=worker,
        pid=os.getpid(),
        output_uri=output_uri,
        errors_uri=errors_uri,
        records=succeeded + failed,
        succeeded=succeeded,
        failed=failed,
        started_at=started_at,
        finished_at=time.time(),
        compute_seconds=round(compute_seconds, 4),
        load_seconds=round(lookup.load_seconds, 4),
        cache_hit=lookup.hit,
        model_loads=cache.loads_of(spec.model.cache_key),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
    if not store.put_if_absent(spec.commit_uri, orjson.dumps(manifest.to_dict())):
        # Another attempt committed first; ours is an orphan and the committed one stands.
        store.delete_prefix(output_uri)
        store.delete_prefix(errors_uri)
        winner = read_committed_manifest(spec)
        assert winner is not None
        return winner
    return manifest
