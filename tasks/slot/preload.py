"""Preloading a slot's models when its worker process starts (`launch --preload NAME ...`).

A model that will not load fails the slot's start, not every shard the slot would have taken: the
process asks its worker to shut down and exits, so the launcher restarts the slot with backoff and
its shards stay in the queue for healthy slots.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from celery.signals import worker_process_init

from gpuworkers.cache import process_cache
from gpuworkers.settings import device, preload_references
from tasks.shared.catalog import find_spec

logger = logging.getLogger(__name__)

PRELOAD_FAILED_EXIT_CODE = 78  # EX_CONFIG


@worker_process_init.connect
def preload_models(**_: Any) -> None:
    for reference in preload_references():
        try:
            spec = find_spec(reference)
            lookup = process_cache().get(spec, device=device())
        except Exception as exc:
            logger.critical(
                "cannot preload model %s: %s: %s; this slot will not start", reference, type(exc).__name__, exc
            )
            # Stop the whole worker at once (SIGQUIT: Celery's cold shutdown; nothing runs yet): its
            # pool would only start another child that fails the same way. The launcher restarts
            # the slot with backoff, and logs it.
            os.kill(os.getppid(), signal.SIGQUIT)
            os._exit(PRELOAD_FAILED_EXIT_CODE)
        logger.info("preloaded model %s in %.1f s", reference, lookup.load_seconds)
