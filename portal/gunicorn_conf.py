"""gunicorn settings for the portal: `gunicorn portal.wsgi --config python:portal.gunicorn_conf`.

With PROMETHEUS_MULTIPROC_DIR set (an empty directory, one per portal host), each gunicorn worker
writes its request metrics there and /metrics sums them; a worker that exits has its live gauges
removed here, as prometheus_client's multiprocess mode asks.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client.multiprocess import mark_process_dead


def child_exit(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        mark_process_dead(worker.pid)
