"""The cost of a slot's metrics for one shard, timed in a process of its own (`make bench`).

`python -m bench.instrumentation SHARDS MICRO_BATCHES` makes, for each of SHARDS shards,
the metric calls `tasks.slot.shard_execution` and the warm cache make for a shard of MICRO_BATCHES
micro-batches, in prometheus_client's multiprocess mode as under a launcher (a temporary directory
is set before prometheus_client is imported), and prints the mean seconds per shard. No Django.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time


def seconds_per_shard(shards: int, micro_batches: int) -> float:
    from gpuworkers import metrics

    start = time.perf_counter()
    for _ in range(shards):
        labels = metrics.model_labels("bench-model")
        metrics.MODEL_CACHE_HITS.labels(*labels).inc()
        with metrics.slot_clock.busy():
            observe = metrics.MICRO_BATCH_SIZE.labels(*labels).observe
            for _ in range(micro_batches):
                observe(256)
            metrics.SLOT_RECORDS.labels(*labels, "succeeded").inc(256 * micro_batches)
            metrics.SLOT_RECORDS.labels(*labels, "failed").inc(0)
            metrics.SLOT_TOKENS.labels(*labels, "prompt").inc(0)
            metrics.SLOT_TOKENS.labels(*labels, "completion").inc(0)
        metrics.SHARD_ATTEMPTS.labels(*labels, "committed").inc()
        metrics.SHARD_DURATION.labels(*labels).observe(1.0)
    return (time.perf_counter() - start) / shards


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        if "prometheus_client" in sys.modules:
            raise SystemExit("prometheus_client was imported before its multiprocess directory was set")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        print(seconds_per_shard(int(sys.argv[1]), int(sys.argv[2])))
