"""``s3://bucket/prefix/`` to a local model directory: list, find or fill the cache entry, hold it.

Every call lists the prefix (one request) so that a new upload is seen at the next load; the
objects themselves are fetched only when no entry on this host has the listing's digest.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from gpuworkers import metrics, settings
from gpuworkers.weights import holds
from gpuworkers.weights.client import s3_client
from gpuworkers.weights.download import fetch_listing
from gpuworkers.weights.listing import list_source
from gpuworkers.weights.store import WeightStore

logger = logging.getLogger(__name__)

_stores: dict[Path, WeightStore] = {}
_stores_lock = threading.Lock()


def open_store() -> WeightStore:
    """This process's view of the host cache (``BATCHERY_MODEL_CACHE_DIR``); the first open sweeps it."""
    root = settings.model_cache_dir()
    with _stores_lock:
        store = _stores.get(root)
        if store is None:
            store = _stores[root] = WeightStore(root, budget_bytes=settings.model_cache_bytes())
        return store


def resolve_s3_source(source: str) -> Path:
    """The cache directory holding what ``source`` lists now, downloaded if this host lacks it.

    The entry stays held (never evicted) until the model loading now is unloaded (see `holds`).
    Raises EngineLoadError when retrying cannot help, WeightsUnavailableError when it may.
    """
    labels = metrics.model_labels(holds.current_model())
    client = s3_client()
    try:
        listing = list_source(client, source)
        store = open_store()

        def fill(staging: Path) -> None:
            started = time.perf_counter()
            fetch_listing(
                client,
                listing,
                staging,
                part_bytes=settings.model_download_part_bytes(),
                concurrency=settings.model_download_concurrency(),
            )
            seconds = time.perf_counter() - started
            metrics.WEIGHTS_DOWNLOAD_DURATION.labels(*labels).observe(seconds)
            logger.info(
                "downloaded %s (%d files, %d bytes) in %.1f s",
                source, len(listing.objects), listing.total_bytes, seconds,
            )  # fmt: skip

        entry = store.open_entry(listing.digest, size=listing.total_bytes, fill=fill, source=source)
    except Exception:
        metrics.WEIGHTS_DOWNLOAD_FAILURES.labels(*labels).inc()
        raise
    holds.keep(entry.hold, source=source, path=entry.path)
    if entry.downloaded:
        metrics.WEIGHTS_CACHE_MISSES.labels(*labels).inc()
        metrics.WEIGHTS_DOWNLOAD_BYTES.labels(*labels).inc(listing.total_bytes)
    else:
        metrics.WEIGHTS_CACHE_HITS.labels(*labels).inc()
    metrics.WEIGHTS_CACHE_BYTES.labels(labels[0]).set(store.held_bytes())
    return entry.path
