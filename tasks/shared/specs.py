"""The value objects that cross the broker, a shard's spec (in) and its manifest (out), and the commit marker.

`run_shard` never touches the database, so the spec carries everything the shard needs and the
manifest everything the merge needs. Both are plain JSON. A shard's first attempt to write its
commit marker (`commit_uri`) wins; `read_commit` is how the worker and the control side read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from gpuworkers.spec import AdapterSpec, ModelSpec
from tasks.shared.storage import join_uri, store_for


@dataclass(frozen=True)
class ShardSpec:
    """Everything a worker needs to run one shard."""

    job_id: str
    """The job's id (a UUID string)."""
    shard_index: int
    """0-based position of the shard in the job; outputs are merged in this order."""
    record_count: int
    """Records in the shard's input; the manifest must account for each."""
    input_uri: str
    """The shard's input JSONL, written by the planner."""
    shard_prefix: str
    """Storage prefix for this shard's attempts and its commit marker."""
    model: ModelSpec
    """The catalog model to run."""
    input_field: str
    """The record field the model's task reads (`input`, `prompt`, `messages`)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Run-time parameters: the model's defaults overlaid with the job's."""
    hold_uri: str = ""
    """An object that exists while the job is paused: a shard that finds it on arrival does not start."""
    output_format: str = "jsonl"
    """The job's output format; with "parquet" each attempt also writes its rows as a Parquet piece."""
    adapters: dict[str, AdapterSpec] = field(default_factory=dict)
    """The LoRA adapters of ``model`` that the job's records may name (their ``model`` field), by that name."""
    adapter: str = ""
    """The adapter, of ``adapters``, that records naming no model run with; empty: the base model."""
    weights_digest: str = ""
    """The digest of the weights the job is pinned to (`gpuworkers.weights.digest`); a slot holding others
    refuses the shard. Empty: any."""

    @property
    def commit_uri(self) -> str:
        return commit_uri(self.shard_prefix)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardSpec:
        adapters = {name: AdapterSpec.from_dict(spec) for name, spec in (data.get("adapters") or {}).items()}
        return cls(**{**data, "model": ModelSpec.from_dict(data["model"]), "adapters": adapters})


@dataclass(frozen=True)
class ShardManifest:
    """What one committed attempt of a shard produced; stored as the shard's commit marker."""

    job_id: str
    shard_index: int
    attempt_id: str
    """Unique per attempt; names the attempt's output objects."""
    worker: str
    """Celery hostname of the worker that ran it."""
    pid: int
    """Process that ran it (the warm model lives in this process)."""
    output_uri: str
    """One line per input record, in input order: a response or an error."""
    errors_uri: str
    """Only the error lines; empty when no record failed (no such file was written)."""
    records: int
    succeeded: int
    failed: int
    started_at: float
    """Unix time the attempt started."""
    finished_at: float
    compute_seconds: float
    """Time spent in the engine, model loading excluded."""
    load_seconds: float
    """Time spent loading the model; 0 when the warm cache had it."""
    cache_hit: bool
    """True when the model was already loaded in this process."""
    model_loads: int
    """How many times this process has loaded this model, this attempt included."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter_usage: dict[str, list[int]] = field(default_factory=dict)
    """Per adapter a record ran with (``name@version``; ``""`` for the base model alone), when the shard named
    any: ``[records succeeded, records failed, prompt tokens, completion tokens]``."""
    error_codes: dict[str, int] = field(default_factory=dict)
    """How many of the failed records got each error code; the control side counts outcomes by code."""
    parquet_uri: str = ""
    """The attempt's rows as a Parquet piece (`tasks.shared.formats.parquet_pieces`), which the merge of a
    Parquet output concatenates; empty where none was written (JSONL output, a worker from before
    pieces, rows Parquet cannot hold), and the merge then converts the JSONL."""
    cached_prompt_tokens: int = 0
    """Of ``prompt_tokens``, those served from a prefix cache (another record computed them): OpenAI's
    ``cached_tokens``, summed."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """How the attempt's output was made (`tasks.slot.provenance`): the model's files by digest as its
    process loaded them, the engine's and the software's versions, the GPU class and host."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardManifest:
        return cls(**data)


@dataclass(frozen=True)
class ShardSkipped:
    """What a shard returns instead of a manifest when its job was stopped (cancelled, expired)."""

    job_id: str
    shard_index: int
    skipped: str
    """The stop reason."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def commit_uri(shard_prefix: str) -> str:
    return join_uri(shard_prefix, "commit.json")


def started_uri(shard_prefix: str) -> str:
    """The prefix under which each attempt of the shard leaves a marker as it starts."""
    return join_uri(shard_prefix, "started")


def attempt_started(shard_prefix: str) -> bool:
    """Whether any attempt of the shard has started."""
    uri = started_uri(shard_prefix)
    return next(iter(store_for(uri).list_prefix(uri)), None) is not None


def read_commit(shard_prefix: str) -> ShardManifest | None:
    """The manifest of the shard's committed attempt (the first writer of its commit marker), or None."""
    uri = commit_uri(shard_prefix)
    store = store_for(uri)
    if not store.exists(uri):
        return None
    return ShardManifest.from_dict(orjson.loads(store.read_bytes(uri)))
