"""The warm model cache: one per worker process, so a model loads once and serves many shards.

Models are kept least-recently-used first, keyed by `ModelSpec.cache_key` (name, version), within a
byte budget (`settings.cache_budget_bytes`). Before a load, models are evicted until the newcomer
fits. Its size is known only once it has been loaded, so a model never loaded in this process is
assumed to need the whole budget: on its first load every other model goes, which on a GPU is the
safe guess; later loads of it evict only what its measured size requires.

A model whose weights came from the host's disk cache (an ``s3://`` source) keeps that cache entry
held from the start of its load until it is unloaded here, so no slot of the host deletes the files
under a loaded model (see `gpuworkers.weights.holds`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gpuworkers import metrics, settings
from gpuworkers.engines.base import Engine, HoldsAdapters, SharesProcessState, create_engine
from gpuworkers.spec import ModelSpec
from gpuworkers.weights.digest import ModelDigest, model_digest
from gpuworkers.weights.holds import LoadScope, load_scope

logger = logging.getLogger(__name__)

CacheKey = tuple[str, str]


@dataclass(frozen=True)
class CacheLookup:
    """The answer of `ModelCache.get`."""

    engine: Engine
    """The loaded engine, ready for `run_batch`."""
    hit: bool
    """True when the engine was already loaded."""
    load_seconds: float
    """Seconds spent building and loading the engine; 0.0 on a hit."""
    files: ModelDigest | None = None
    """The files the engine was loaded from, by digest (`gpuworkers.weights.digest`), read at its load."""


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters."""

    loads: int
    """Engines loaded since the cache was created (failed loads not counted)."""
    hits: int
    """Lookups answered by an engine already loaded."""
    evictions: int
    """Engines unloaded to make room."""
    resident: int
    """Engines loaded now."""
    resident_bytes: int
    """Bytes the loaded engines hold, as they report it."""
    budget_bytes: int | None
    """The byte budget; None until the first lookup tells the cache its device."""


@dataclass
class _Entry:
    engine: Engine
    size: int
    weights: LoadScope
    files: ModelDigest | None
    """The disk cache entries the engine's weights came from, held until it is unloaded."""

    def unload(self) -> None:
        try:
            self.engine.unload()
        finally:
            self.weights.release()


class ModelCache:
    """An LRU of loaded engines bounded by a byte budget; a lock makes lookups one at a time."""

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        engine_factory: Callable[[ModelSpec], Engine] = create_engine,
    ) -> None:
        """``budget_bytes`` None: read from settings for the device of the first lookup."""
        self._budget = budget_bytes
        self._engine_factory = engine_factory
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._known_sizes: dict[CacheKey, int] = {}
        self._load_counts: Counter[CacheKey] = Counter()
        self._hits = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def get(self, spec: ModelSpec, *, device: str) -> CacheLookup:
        """The loaded engine for ``spec``, loading it (and evicting others) when it is not resident.

        A load that fails (`EngineLoadError` or anything else) propagates and leaves nothing cached.
        """
        key = spec.cache_key
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                metrics.MODEL_CACHE_HITS.labels(*metrics.model_labels(spec.name)).inc()
                return CacheLookup(engine=entry.engine, hit=True, load_seconds=0.0, files=entry.files)
            budget = self._budget_for(device)
            self._evict_until_free(self._known_sizes.get(key, budget), budget)
            started = time.perf_counter()
            with load_scope(spec.name) as weights:
                try:
                    engine = self._engine_factory(spec)
                    self._evict_sharing(engine)
                    engine.load(device=device)
                    # Read where the engine read its weights (an s3:// source's cache entry, held).
                    files = model_digest(spec, resolved=weights.resolved)
                except BaseException:
                    weights.release()
                    metrics.MODEL_LOAD_FAILURES.labels(*metrics.model_labels(spec.name)).inc()
                    self._publish_bytes()
                    raise
            load_seconds = time.perf_counter() - started
            size = engine.memory_bytes()
            self._entries[key] = _Entry(engine=engine, size=size, weights=weights, files=files)
            self._known_sizes[key] = size
            self._load_counts[key] += 1
            metrics.MODEL_LOADS.labels(*metrics.model_labels(spec.name)).inc()
            metrics.MODEL_LOAD_DURATION.labels(*metrics.model_labels(spec.name)).observe(load_seconds)
            # The measured size may exceed the estimate; trim the others to keep within the budget.
            self._evict_until_free(0, budget, keep=key)
            self._publish_bytes()
            if size > budget:
                logger.warning("model %s:%s holds %d bytes, over the cache budget of %d", *key, size, budget)
            logger.info("loaded model %s:%s on %s in %.2f s (%d bytes)", *key, device, load_seconds, size)
            return CacheLookup(engine=engine, hit=False, load_seconds=load_seconds, files=files)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                loads=sum(self._load_counts.values()),
                hits=self._hits,
                evictions=self._evictions,
                resident=len(self._entries),
                resident_bytes=self._resident_bytes(),
                budget_bytes=self._budget,
            )

    def resident(self) -> list[CacheKey]:
        """The (name, version) of every loaded model, least recently used first."""
        with self._lock:
            return list(self._entries)

    def loaded_adapters(self) -> list[str]:
        """Fingerprints of the LoRA adapters loaded beside the resident models (`HoldsAdapters`)."""
        with self._lock:
            engines = [entry.engine for entry in self._entries.values()]
        return sorted(
            {key for engine in engines if isinstance(engine, HoldsAdapters) for key in engine.loaded_adapters()}
        )

    def loads_of(self, key: CacheKey) -> int:
        """How many times the model with this (name, version) was loaded by this cache."""
        with self._lock:
            return self._load_counts[key]

    def clear(self) -> None:
        """Unload every engine, e.g. when the worker shuts down; counters are kept."""
        with self._lock:
            while self._entries:
                _, entry = self._entries.popitem(last=False)
                entry.unload()
            self._publish_bytes()

    def _budget_for(self, device: str) -> int:
        if self._budget is None:
            self._budget = settings.cache_budget_bytes(device)
        return self._budget

    def _resident_bytes(self) -> int:
        return sum(entry.size for entry in self._entries.values())

    def _publish_bytes(self) -> None:
        metrics.MODEL_CACHE_BYTES.labels(*metrics.slot_labels()).set(self._resident_bytes())

    def _evict_until_free(self, needed: int, budget: int, *, keep: CacheKey | None = None) -> None:
        for key in list(self._entries):
            if self._resident_bytes() + needed <= budget:
                return
            if key != keep:
                self._evict(key)

    def _evict_sharing(self, engine: Engine) -> None:
        """Unload the resident engines that hold the process-wide state `engine` will hold (`SharesProcessState`)."""
        state = engine.process_state() if isinstance(engine, SharesProcessState) else None
        if state is None:
            return
        for key, entry in list(self._entries.items()):
            if isinstance(entry.engine, SharesProcessState) and entry.engine.process_state() == state:
                self._evict(key)

    def _evict(self, key: CacheKey) -> None:
        entry = self._entries.pop(key)
        entry.unload()
        self._evictions += 1
        metrics.MODEL_CACHE_EVICTIONS.labels(*metrics.model_labels(key[0])).inc()
        logger.info("evicted model %s:%s (%d bytes) from the warm cache", *key, entry.size)


_process_cache: ModelCache | None = None
_process_cache_lock = threading.Lock()


def process_cache() -> ModelCache:
    """The one warm cache of this worker process, created on first use."""
    global _process_cache
    with _process_cache_lock:
        if _process_cache is None:
            _process_cache = ModelCache()
        return _process_cache
