"""gunicorn settings for the portal: `gunicorn portal.wsgi --config python:portal.gunicorn_conf`.

With PROMETHEUS_MULTIPROC_DIR set (an empty directory, one per portal host), each gunicorn worker
writes its request metrics there and /metrics sums them; a worker that exits has its live gauges
removed here, as prometheus_client's multiprocess mode asks.

Each worker freezes what it holds once it has loaded the portal (`post_worker_init`): a full garbage
collection walks every object alive, and the request that pays for it sets the API's tail latency.
What a worker holds after start-up (modules, URL patterns, settings) lives as long as the worker, and
frozen it is no longer walked.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from prometheus_client.multiprocess import mark_process_dead


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        mark_process_dead(worker.pid)


def post_worker_init(worker: Any) -> None:
    from django.urls import get_resolver

    # Django imports the views on the first request it routes: imported here, they are frozen with the rest.
    get_resolver().url_patterns  # noqa: B018  (the property imports them)
    gc.collect()
    gc.freeze()
