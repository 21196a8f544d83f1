"""What monitoring costs: the whole-stack job with the launcher's metrics on and off, and scrape times.

`stack_rate` runs one embedding job through a fresh stack and returns records per second; with
metrics on, the launcher serves /metrics from its slots' multiprocess files and the benchmark
scrapes it every second while the job runs, as Prometheus would. With metrics off (port 0) the
slots count in memory only and nothing is served. `scrape_p99` starts a launcher of `slots` cpu
slots, lets each slot record, and times `count` scrapes of its /metrics.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from bench.job import timed_job
from portal.devstack.embedded import free_port
from portal.devstack.stack import Stack, StackOptions
from portal.jobs.management.commands.submit import watch_job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.config import metrics_token


def _request(url: str) -> urllib.request.Request:
    """A scrape as Prometheus sends it: with the bearer token where the launcher asks for one."""
    token = metrics_token()
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})


def _scrape(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(_request(url), timeout=10) as response:
        response.read()
    return time.perf_counter() - started


@dataclass(frozen=True)
class StackRun:
    records_per_s: float
    """The job's records over its time from submission to merged output."""
    shard_seconds: float
    """Mean start-to-commit time of its shards, as their manifests recorded it."""
    shard_records: int
    """Records per shard."""


def stack_rate(*, dataset: Path, warmup: Path, model: str, cpu_slots: int, metrics: bool) -> StackRun:
    """One job on a fresh stack: its rate and its shards' size and duration."""
    port = free_port() if metrics else 0
    stack = Stack(StackOptions(portal=False, flower=False, cpu_slots=cpu_slots, logs_to_files=True, metrics_port=port))
    stack.start()
    stop = threading.Event()
    try:
        stack.wait_for_workers(queues={"control", "planning", "gpu.cpu"})
        tenant = tenant_get_or_create(name="bench")
        watch_job(job_submit(tenant=tenant, request=JobRequest(model_name=model, input_uri=str(warmup), shard_size=50)))
        if metrics:

            def scrape_every_second() -> None:
                while not stop.wait(1.0):
                    _scrape(f"http://127.0.0.1:{port}/metrics")

            threading.Thread(target=scrape_every_second, daemon=True).start()
        job, elapsed = timed_job(tenant=tenant, model_name=model, dataset=dataset)
    finally:
        stop.set()
        stack.stop()
    durations = [
        (shard.finished_at - shard.started_at).total_seconds()
        for shard in job.shards.all()
        if shard.finished_at and shard.started_at
    ]
    return StackRun(
        records_per_s=job.succeeded_records / elapsed,
        shard_seconds=sum(durations) / max(1, len(durations)),
        shard_records=round((job.total_records or 0) / max(1, job.shard_count)),
    )


def instrumentation_seconds_per_shard(*, micro_batches: int, shards: int = 2000) -> float:
    """Seconds a slot spends on its metrics for one shard, timed in a process of its own (see
    `bench.instrumentation`: multiprocess mode needs its directory set before import)."""
    finished = subprocess.run(
        [sys.executable, "-m", "bench.instrumentation", str(shards), str(micro_batches)],
        env={**os.environ, "BATCHERY_SLOT": "0"},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(finished.stdout.strip())


def scrape_p99(*, slots: int, count: int) -> tuple[float, float]:
    """(p50, p99) seconds of one scrape of a launcher with `slots` slots whose processes have all recorded."""
    port = free_port()
    env = {**os.environ, "BATCHERY_HEARTBEAT_INTERVAL_S": "1"}
    log = (Path(settings.VAR_DIR) / "logs" / "bench-scrape-launcher.log").open("ab")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuworkers", "launch", "--cpu-slots", str(slots), "--metrics-port", str(port),
         "--metrics-address", "127.0.0.1", "--loglevel", "WARNING"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(_request(url), timeout=5).read().decode()
            except OSError:
                text = ""
            # Every slot's clock has written its files once its pool child started.
            if text.count("batchery_slot_idle_seconds_total{") >= slots:
                break
            time.sleep(1)
        times = sorted(_scrape(url) for _ in range(count))
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)
        log.close()
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]
