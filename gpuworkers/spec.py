"""Value objects that describe a model to a worker process.

A `ModelSpec` travels inside every shard message, so it is small, frozen and JSON-friendly.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to load a catalog model, without asking the database."""

    name: str
    """Catalog name, e.g. ``all-MiniLM-L6-v2``."""
    version: str
    """Catalog version; the warm cache keys on (name, version)."""
    engine: str
    """Engine name: ``sentence_transformers``, ``transformers``, ``python`` or ``vllm``."""
    task: str
    """``embed``, ``generate``, ``chat`` or ``classify``."""
    source: str
    """Where the weights are: a local path, ``file:///path``, ``package:NAME`` (a package that ships them)
    or ``s3://bucket/prefix/`` (fetched into the host's weight cache, `gpuworkers.weights`); for the
    ``python`` engine, the entry point ``package.module:factory`` that builds the model."""
    gpus_per_replica: int = 1
    """GPUs one replica needs (tensor parallel size)."""
    load_params: dict[str, Any] = field(default_factory=dict)
    """Engine arguments used at load time (dtype, max_seq_length, ...)."""

    @property
    def cache_key(self) -> tuple[str, str]:
        return (self.name, self.version)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**data)


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter of a base model, as a worker loads it beside that model (PEFT layout, safetensors)."""

    name: str
    """Catalog name, as a job or a record names it in place of the base model."""
    version: str
    source: str
    """Where the adapter's files are (``adapter_config.json``, ``adapter_model.safetensors``): a local path,
    ``file:///path`` or ``s3://bucket/prefix/``, fetched like a base model's weights."""
    rank: int
    """The LoRA rank (``r``), which an engine sizes its adapter slots by (vLLM's ``max_lora_rank``)."""

    @property
    def fingerprint(self) -> str:
        """Names these files at this version wherever they are loaded: what an engine keeps the adapter (and
        the prefixes computed with it) under, since two tenants' adapters may share a name, and what a slot's
        heartbeat reports it holds, which names no tenant's adapter to the fleet."""
        digest = hashlib.sha256(f"{self.source}\n{self.version}".encode()).hexdigest()
        return f"lora_{digest[:16]}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterSpec:
        return cls(**data)
