"""The GPU host's Prometheus metrics, defined once: slot processes record them, the launcher serves them.

A slot's work runs in a Celery prefork child, which the pool may replace at any time. The launcher
points every slot process at one `prometheus_client` multiprocess directory
(``PROMETHEUS_MULTIPROC_DIR``, set before any of them imports `prometheus_client`), so each process
writes its own memory-mapped file and the launcher's one port sums them all: a count never depends
on which child answered, and a child that exited still counts. Outside a launcher (tests, a plain
worker) the same objects count in memory.

Every series carries the slot's `host`, `slot` and `gpu_class`; none carries a job id.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from prometheus_client import Counter, Gauge, Histogram

from gpuworkers.settings import slot_gpu_class, slot_name

SLOT_LABELS = ("host", "slot", "gpu_class")
MODEL_LABELS = (*SLOT_LABELS, "model")

# Records per micro-batch: powers of two up to the largest batch a slot is likely to be given.
MICRO_BATCH_BUCKETS = tuple(float(2**n) for n in range(13))
SHARD_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
MODEL_LOAD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
WEIGHTS_DOWNLOAD_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)

SLOT_BUSY_SECONDS = Counter("batchery_slot_busy_seconds", "Time the slot spent running a shard.", SLOT_LABELS)
SLOT_IDLE_SECONDS = Counter(
    "batchery_slot_idle_seconds", "Time the slot's worker was up and ran no shard.", SLOT_LABELS
)
SLOT_RECORDS = Counter(
    "batchery_slot_records", "Records run through the engine, by outcome.", (*MODEL_LABELS, "outcome")
)
SLOT_TOKENS = Counter("batchery_slot_tokens", "Tokens processed, prompt or completion.", (*MODEL_LABELS, "kind"))
MICRO_BATCH_SIZE = Histogram(
    "batchery_micro_batch_size", "Records per micro-batch handed to the engine.", MODEL_LABELS,
    buckets=MICRO_BATCH_BUCKETS,
)  # fmt: skip
SHARD_ATTEMPTS = Counter(
    "batchery_shard_attempts",
    "Shard attempts by outcome: committed, duplicate, lost_race, skipped, error.",
    (*MODEL_LABELS, "outcome"),
)
SHARD_DURATION = Histogram(
    "batchery_shard_duration_seconds", "Start to commit of each committed shard attempt.", MODEL_LABELS,
    buckets=SHARD_DURATION_BUCKETS,
)  # fmt: skip
OOM_SPLITS = Counter("batchery_oom_splits", "Micro-batches split in halves after running out of memory.", MODEL_LABELS)
MODEL_LOADS = Counter("batchery_model_loads", "Models loaded into the warm cache (cache misses).", MODEL_LABELS)
MODEL_LOAD_FAILURES = Counter("batchery_model_load_failures", "Model loads that failed.", MODEL_LABELS)
MODEL_LOAD_DURATION = Histogram(
    "batchery_model_load_duration_seconds", "Time to load a model.", MODEL_LABELS, buckets=MODEL_LOAD_BUCKETS
)
MODEL_CACHE_HITS = Counter("batchery_model_cache_hits", "Lookups served by a model already loaded.", MODEL_LABELS)
MODEL_CACHE_EVICTIONS = Counter("batchery_model_cache_evictions", "Models unloaded to make room.", MODEL_LABELS)
# `livesum`: the bytes of processes still alive, summed per slot; a dead child's models are gone.
MODEL_CACHE_BYTES = Gauge(
    "batchery_model_cache_bytes", "Bytes the slot's loaded models hold.", SLOT_LABELS, multiprocess_mode="livesum"
)

# The host's weight cache (`gpuworkers.weights`): s3:// model sources on local disk, shared by the slots.
WEIGHTS_CACHE_HITS = Counter(
    "batchery_weights_cache_hits", "s3:// model sources found on the host's disk cache, not downloaded.", MODEL_LABELS
)
WEIGHTS_CACHE_MISSES = Counter(
    "batchery_weights_cache_misses", "s3:// model sources downloaded into the host's disk cache.", MODEL_LABELS
)
WEIGHTS_DOWNLOAD_BYTES = Counter(
    "batchery_weights_download_bytes", "Bytes of model weights downloaded and checked.", MODEL_LABELS
)
WEIGHTS_DOWNLOAD_DURATION = Histogram(
    "batchery_weights_download_duration_seconds", "Time to download and check one model's weights.", MODEL_LABELS,
    buckets=WEIGHTS_DOWNLOAD_BUCKETS,
)  # fmt: skip
WEIGHTS_DOWNLOAD_FAILURES = Counter(
    "batchery_weights_download_failures", "s3:// model sources that could not be listed or downloaded.", MODEL_LABELS
)
WEIGHTS_CACHE_EVICTIONS = Counter(
    "batchery_weights_cache_evictions", "Entries deleted from the host's disk cache to make room.", SLOT_LABELS
)
# One disk per host, seen by every slot: the latest reading of any of them is the host's, even a dead one's.
WEIGHTS_CACHE_BYTES = Gauge(
    "batchery_weights_cache_bytes", "Bytes of model weights on the host's disk cache.", ("host",),
    multiprocess_mode="mostrecent",
)  # fmt: skip

DEFINED = (
    SLOT_BUSY_SECONDS, SLOT_IDLE_SECONDS, SLOT_RECORDS, SLOT_TOKENS, MICRO_BATCH_SIZE, SHARD_ATTEMPTS,
    SHARD_DURATION, OOM_SPLITS, MODEL_LOADS, MODEL_LOAD_FAILURES, MODEL_LOAD_DURATION, MODEL_CACHE_HITS,
    MODEL_CACHE_EVICTIONS, MODEL_CACHE_BYTES, WEIGHTS_CACHE_HITS, WEIGHTS_CACHE_MISSES, WEIGHTS_DOWNLOAD_BYTES,
    WEIGHTS_DOWNLOAD_DURATION, WEIGHTS_DOWNLOAD_FAILURES, WEIGHTS_CACHE_EVICTIONS, WEIGHTS_CACHE_BYTES,
)  # fmt: skip
"""Every metric a slot process records, so that the launcher can describe those with no sample yet."""


@cache
def slot_labels() -> tuple[str, str, str]:
    """This process's (host, slot, gpu_class); the launcher sets the slot's environment before it starts."""
    return socket.gethostname(), slot_name(), slot_gpu_class()


def model_labels(model: str) -> tuple[str, str, str, str]:
    return (*slot_labels(), model)


class SlotClock:
    """Splits a slot's wall time into busy (running a shard) and idle, counted as it passes.

    Time is added on each change of state and by `flush`, which a thread calls every second, so
    that a shard of an hour shows as busy while it runs rather than all at once when it ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._since = time.monotonic()

    def _account(self, now: float) -> None:
        counter = SLOT_BUSY_SECONDS if self._busy else SLOT_IDLE_SECONDS
        counter.labels(*slot_labels()).inc(max(0.0, now - self._since))
        self._since = now

    def flush(self) -> None:
        with self._lock:
            self._account(time.monotonic())

    def restart(self) -> None:
        """Start counting from now, idle: a forked pool child must not count its parent's time."""
        with self._lock:
            self._busy = False
            self._since = time.monotonic()

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            self._account(time.monotonic())
            self._busy = True
        try:
            yield
        finally:
            with self._lock:
                self._account(time.monotonic())
                self._busy = False


slot_clock = SlotClock()
_clock_stop = threading.Event()
CLOCK_FLUSH_INTERVAL_S = 1.0


def start_slot_clock() -> None:
    """Count this process's busy and idle time from now on (called when a pool child starts)."""
    slot_clock.restart()

    def tick() -> None:
        while not _clock_stop.wait(CLOCK_FLUSH_INTERVAL_S):
            slot_clock.flush()

    threading.Thread(target=tick, name="slot-clock", daemon=True).start()


def stop_slot_clock() -> None:
    _clock_stop.set()
    slot_clock.flush()
