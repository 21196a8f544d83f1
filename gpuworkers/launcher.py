"""The launcher: one Celery worker process per slot, supervised.

Each child gets CUDA_VISIBLE_DEVICES set to exactly its slot's GPUs, consumes its slot's class queue
and its own queue (`slot_own_queue`: shards routed to it for the adapters it holds) with concurrency 1
and prefetch 1, and has a distinct hostname. A child that dies is restarted with
backoff. SIGTERM drains: children finish their shard (Celery's warm shutdown) and the launcher exits;
a second SIGINT stops everything at once. A drain is bounded: a child still there BATCHERY_SOFT_SHUTDOWN_S
and DRAIN_GRACE_S after it is killed (one whose cold shutdown waits on a broker that is gone never ends).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from gpuworkers.logs import log_format
from gpuworkers.metrics_server import (
    SlotStatus,
    XidWatcher,
    metrics_registry,
    prepare_metrics_dir,
    serve_metrics,
    sweep_dead_processes,
)
from gpuworkers.slots import Slot
from tasks.shared.config import SOFT_SHUTDOWN_S, metrics_token, slot_own_queue

logger = logging.getLogger("gpuworkers.launcher")

MAX_BACKOFF_S = 30.0
DRAIN_GRACE_S = 10.0
"""How long past its soft shutdown a slot has to give its shard back and exit, before it is killed."""
DEAD_PROCESS_SWEEP_S = 5.0


def worker_name(slot: Slot, hostname: str) -> str:
    """The slot worker's Celery node name, by which remote control (a drain) addresses it."""
    return f"slot{slot.index}-{slot.gpu_class}@{hostname}"


def worker_command(slot: Slot, *, app: str, hostname: str, loglevel: str) -> list[str]:
    # In json mode the worker's output goes to a log system line by line: no ASCII-art banner.
    quiet = ["--quiet"] if log_format() == "json" else []
    return [
        sys.executable,
        "-m",
        # Celery's command line with Django's import refused: a slot needs only the broker and the store.
        "tasks.slot.worker",
        "--app",
        app,
        *quiet,
        "worker",
        "--queues",
        f"{slot.queue},{slot_own_queue(slot.queue, worker_name(slot, hostname))}",
        "--concurrency",
        "1",
        "--prefetch-multiplier",
        "1",
        "--pool",
        "prefork",
        "--hostname",
        worker_name(slot, hostname),
        "--loglevel",
        loglevel,
        "--without-gossip",
        "--without-mingle",
    ]


def worker_env(
    slot: Slot,
    base: dict[str, str],
    *,
    hostname: str | None = None,
    preload: list[str] | None = None,
    metrics_dir: Path | None = None,
) -> dict[str, str]:
    env = dict(base)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # Set where the launcher runs beside the portal (`manage.py up`); Celery would set Django up in the slot.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    if metrics_dir is not None:
        # Read by prometheus_client when the slot first imports it: every process of every slot
        # writes its own files there, and the launcher's /metrics sums them.
        env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    if preload:
        # Read by `tasks.slot.preload` when the slot's process starts; a model that fails stops the slot.
        env["BATCHERY_PRELOAD"] = ",".join(preload)
    env["CUDA_VISIBLE_DEVICES"] = slot.cuda_visible_devices
    # SIGTERM becomes Celery's soft shutdown: the running shard gets BATCHERY_SOFT_SHUTDOWN_S to
    # finish, then its message goes back to the queue, so a drain is bounded.
    env.setdefault("REMAP_SIGTERM", "SIGQUIT")
    env["BATCHERY_SLOT"] = str(slot.index)
    env["BATCHERY_GPU_CLASS"] = slot.gpu_class
    # The heartbeat carries these, so the portal can tell this worker to stop consuming (drain).
    env["BATCHERY_WORKER_NAME"] = worker_name(slot, hostname or socket.gethostname())
    env["BATCHERY_QUEUE"] = slot.queue
    env["BATCHERY_OWN_QUEUE"] = slot_own_queue(slot.queue, env["BATCHERY_WORKER_NAME"])
    if slot.torch_threads:
        env["BATCHERY_TORCH_THREADS"] = str(slot.torch_threads)
        # Tokenizers and BLAS spawn their own threads; a slot must stay within its share of the cores.
        env["OMP_NUM_THREADS"] = str(slot.torch_threads)
        env["TOKENIZERS_PARALLELISM"] = "false"
    return env


@dataclass
class Child:
    slot: Slot
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    """Restarts in a row, for the backoff; reset once the child has run a while."""
    total_restarts: int = 0
    """Every restart since the launcher started, for /metrics."""
    next_start: float = 0.0
    started_at: float = field(default=0.0)


@dataclass(frozen=True)
class MetricsOptions:
    """Where the launcher serves the host's /metrics."""

    port: int
    """TCP port; 0 serves no metrics."""
    address: str = "0.0.0.0"
    """Address to bind: every interface by default, since Prometheus scrapes from another machine."""
    directory: Path | None = None
    """The slots' multiprocess directory, emptied at start; a new temporary one when None."""


class Launcher:
    def __init__(
        self,
        slots: list[Slot],
        *,
        app: str = "tasks.slot.app",
        loglevel: str = "INFO",
        preload: list[str] | None = None,
        metrics: MetricsOptions | None = None,
    ) -> None:
        self.slots = slots
        self.preload = preload or []
        self.app = app
        self.loglevel = loglevel
        self.hostname = socket.gethostname()
        self.children = [Child(slot=slot) for slot in slots]
        self.metrics = metrics or MetricsOptions(port=0)
        self.metrics_dir: Path | None = None
        self._draining = False
        self._drain_ends = 0.0
        self._interrupts = 0
        self._last_sweep = 0.0
        self._owns_metrics_dir = False

    def slot_statuses(self) -> list[SlotStatus]:
        return [
            SlotStatus(
                slot=child.slot,
                up=child.process is not None and child.process.poll() is None,
                restarts=child.total_restarts,
            )
            for child in self.children
        ]

    def _start_metrics(self) -> None:
        if not self.metrics.port:
            return
        self.metrics_dir = prepare_metrics_dir(self.metrics.directory)
        self._owns_metrics_dir = self.metrics.directory is None
        xids = XidWatcher(gpu for slot in self.slots for gpu in slot.gpus)
        xids.start()
        registry = metrics_registry(self.metrics_dir, self.slot_statuses, xids)
        serve_metrics(registry, port=self.metrics.port, address=self.metrics.address, token=metrics_token())

    def _sweep_metrics(self, now: float) -> None:
        if self.metrics_dir is None or now - self._last_sweep < DEAD_PROCESS_SWEEP_S:
            return
        self._last_sweep = now
        sweep_dead_processes(self.metrics_dir)

    def _start(self, child: Child) -> None:
        command = worker_command(child.slot, app=self.app, hostname=self.hostname, loglevel=self.loglevel)
        env = worker_env(
            child.slot, dict(os.environ), hostname=self.hostname, preload=self.preload, metrics_dir=self.metrics_dir
        )
        child.process = subprocess.Popen(command, env=env)
        child.started_at = time.monotonic()
        logger.info(
            "slot %d (%s, CUDA_VISIBLE_DEVICES=%r) started as pid %d on %s",
            child.slot.index,
            child.slot.gpu_class,
            child.slot.cuda_visible_devices,
            child.process.pid,
            child.slot.queue,
        )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
        if self._interrupts >= 2:
            logger.warning("second interrupt: stopping every slot now")
            self._signal_children(signal.SIGKILL)
        else:
            logger.info("draining: each slot finishes its shard, then exits")
            self._signal_children(signal.SIGTERM)
        if not self._draining:
            self._drain_ends = time.monotonic() + SOFT_SHUTDOWN_S + DRAIN_GRACE_S
        self._draining = True

    def _signal_children(self, signum: int) -> None:
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)

    def _supervise_once(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.process is None:
                if now >= child.next_start:
                    self._start(child)
                continue
            code = child.process.poll()
            if code is None:
                continue
            # A child that ran a while before dying starts over at the shortest backoff.
            if now - child.started_at > 60:
                child.restarts = 0
            backoff = min(MAX_BACKOFF_S, 0.5 * 2**child.restarts)
            child.restarts += 1
            child.total_restarts += 1
            logger.warning(
                "slot %d worker pid %d exited with %s; restarting in %.1fs",
                child.slot.index,
                child.process.pid,
                code,
                backoff,
            )
            child.process = None
            child.next_start = now + backoff
        self._sweep_metrics(now)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._start_metrics()
        while not self._draining:
            self._supervise_once()
            time.sleep(0.2)
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, self._drain_ends - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("slot %d did not stop within its drain: killed", child.slot.index)
                child.process.kill()
                child.process.wait()
        if self.metrics_dir is not None and self._owns_metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        logger.info("all slots stopped")
        return 0
