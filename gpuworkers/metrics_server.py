"""The launcher's `/metrics`: one port for every slot of the host, read at scrape time.

What it serves, in one registry:
- the slots' own metrics (`gpuworkers.metrics`), summed from the multiprocess directory that every
  slot process writes to (the launcher wipes it at start and removes the live-gauge files of
  processes that died, as `prometheus_client.multiprocess.mark_process_dead` does);
- every slot metric not yet recorded, described without samples, so that dashboards and alert
  rules find each name from the first scrape;
- per GPU, read from NVML by the launcher itself (dcgm-exporter's `gpu`, `UUID`, `modelName` labels);
- per slot, whether its worker process runs and how often the launcher restarted it;
- vLLM's own statistics, re-exported under vLLM's names from the snapshots slots write
  (`gpuworkers.vllm_metrics`).

With BATCHERY_METRICS_TOKEN set (every shipped deployment sets it), `/metrics` asks for
`Authorization: Bearer <token>`, as the portal's does; `/healthz` answers `ok` to anyone, for the
liveness probes, and tells nothing else.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from gpuworkers import metrics
from gpuworkers.nvml import nvml_session
from gpuworkers.slots import Slot
from gpuworkers.vllm_metrics import read_vllm_snapshots

logger = logging.getLogger(__name__)

_PID_FILE = re.compile(r"^(?:\w+_)*?(\d+)\.(?:db|json)$")
GPU_LABELS = ("host", "gpu", "UUID", "modelName", "gpu_class", "slot")


@dataclass(frozen=True)
class SlotStatus:
    """What the launcher knows of one slot when it is scraped."""

    slot: Slot
    up: bool
    """True while the slot's worker process runs."""
    restarts: int
    """Times the launcher restarted the slot's worker since the launcher started."""


def prepare_metrics_dir(path: Path | None) -> Path:
    """An empty multiprocess directory: the one given (emptied), or a new temporary one."""
    if path is None:
        return Path(tempfile.mkdtemp(prefix="batchery-metrics-"))
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_processes(path: Path) -> list[int]:
    """Forget the live gauges (and vLLM snapshots) of processes that are gone; return their pids.

    Counters and histograms of dead processes stay: what a replaced pool child counted still counts.
    """
    pids = {int(match.group(1)) for name in os.listdir(path) if (match := _PID_FILE.match(name))}
    dead = [pid for pid in pids if not _pid_alive(pid)]
    for pid in dead:
        mark_process_dead(pid, str(path))
        (path / f"vllm_{pid}.json").unlink(missing_ok=True)
    return dead


class SlotMetricsCollector(Collector):
    """The slots' metrics from the multiprocess directory, plus empty families for those not yet seen."""

    def __init__(self, path: Path) -> None:
        self._files = MultiProcessCollector(None, path=str(path))

    def collect(self) -> Iterator[Metric]:
        seen = set()
        for family in self._files.collect():
            # vLLM, when loaded in a slot process, may write its own multiprocess files here; its
            # statistics are served from the snapshots instead, once, with the slot's labels.
            if family.name.startswith("vllm:"):
                continue
            seen.add(family.name)
            yield family
        for defined in metrics.DEFINED:
            for family in defined.describe():
                if family.name not in seen:
                    yield family


class HostCollector(Collector):
    """GPUs from NVML and the launcher's view of its slots, read at each scrape."""

    def __init__(self, statuses: Callable[[], list[SlotStatus]], xids: XidWatcher | None = None) -> None:
        self._statuses = statuses
        self._xids = xids
        self._host = socket.gethostname()

    def collect(self) -> Iterator[Metric]:
        statuses = self._statuses()
        yield from self._slot_families(statuses)
        yield from self._gpu_families(statuses)

    def _slot_families(self, statuses: list[SlotStatus]) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "batchery_slot_up",
            "1 while the slot's worker process runs.",
            labels=("host", "slot", "gpu_class", "queue_name"),
        )
        restarts = CounterMetricFamily(
            "batchery_slot_restarts",
            "Times the launcher restarted the slot's worker.",
            labels=("host", "slot", "gpu_class"),
        )
        for status in statuses:
            slot = status.slot
            up.add_metric([self._host, str(slot.index), slot.gpu_class, slot.queue], 1.0 if status.up else 0.0)
            restarts.add_metric([self._host, str(slot.index), slot.gpu_class], float(status.restarts))
        yield up
        yield restarts

    def _gpu_families(self, statuses: list[SlotStatus]) -> Iterator[Metric]:
        def gauge(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=GPU_LABELS)

        utilization = gauge("batchery_gpu_utilization_ratio", "GPU utilization reported by NVML, 0 to 1.")
        used = gauge("batchery_gpu_memory_used_bytes", "Device memory in use.")
        total = gauge("batchery_gpu_memory_total_bytes", "Device memory.")
        temperature = gauge("batchery_gpu_temperature_celsius", "GPU core temperature.")
        power = gauge("batchery_gpu_power_watts", "GPU power draw.")
        xid = CounterMetricFamily(
            "batchery_gpu_xid_errors",
            "XID errors NVML reported since the launcher started.",
            labels=(*GPU_LABELS, "xid"),
        )
        owners = {gpu: status.slot for status in statuses for gpu in status.slot.gpus}
        for reading in read_gpus(sorted(owners)):
            slot = owners[reading.index]
            labels = [self._host, str(reading.index), reading.uuid, reading.name, slot.gpu_class, str(slot.index)]
            for family, value in (
                (utilization, reading.utilization),
                (used, reading.memory_used),
                (total, reading.memory_total),
                (temperature, reading.temperature),
                (power, reading.power_watts),
            ):
                if value is not None:
                    family.add_metric(labels, value)
            if self._xids is not None:
                for code, count in self._xids.counts(reading.index).items():
                    xid.add_metric([*labels, str(code)], float(count))
        yield from (utilization, used, total, temperature, power, xid)


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    utilization: float | None
    memory_used: float | None
    memory_total: float | None
    temperature: float | None
    power_watts: float | None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpus(indexes: Iterable[int]) -> list[GpuReading]:
    """One reading per NVML device index; empty without NVML. A figure the device lacks is None."""
    indexes = list(indexes)
    if not indexes:
        return []
    with nvml_session() as pynvml:
        if pynvml is None:
            return []

        def read(call: Callable[..., Any], *args: Any) -> Any:
            try:
                return call(*args)
            except pynvml.NVMLError:
                return None

        readings = []
        for index in indexes:
            handle = read(pynvml.nvmlDeviceGetHandleByIndex, index)
            if handle is None:
                continue
            rates = read(pynvml.nvmlDeviceGetUtilizationRates, handle)
            memory = read(pynvml.nvmlDeviceGetMemoryInfo, handle)
            temperature = read(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
            milliwatts = read(pynvml.nvmlDeviceGetPowerUsage, handle)
            readings.append(
                GpuReading(
                    index=index,
                    uuid=_text(read(pynvml.nvmlDeviceGetUUID, handle) or ""),
                    name=_text(read(pynvml.nvmlDeviceGetName, handle) or ""),
                    utilization=None if rates is None else rates.gpu / 100.0,
                    memory_used=None if memory is None else float(memory.used),
                    memory_total=None if memory is None else float(memory.total),
                    temperature=None if temperature is None else float(temperature),
                    power_watts=None if milliwatts is None else milliwatts / 1000.0,
                )
            )
        return readings


class XidWatcher:
    """Counts XID errors per device from NVML's event API, on a thread of its own.

    NVML reports an XID as an event, not a counter, so the launcher listens for the host's lifetime.
    Devices that cannot register for events (some virtualised GPUs) are skipped with a warning.
    """

    WAIT_MS = 1000

    def __init__(self, indexes: Iterable[int]) -> None:
        self._indexes = sorted(set(indexes))
        self._counts: dict[int, dict[int, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def counts(self, index: int) -> dict[int, int]:
        with self._lock:
            return dict(self._counts.get(index, {}))

    def record(self, index: int, xid: int) -> None:
        with self._lock:
            per_device = self._counts.setdefault(index, {})
            per_device[xid] = per_device.get(xid, 0) + 1
        logger.error("GPU %d reported XID %d", index, xid)

    def start(self) -> None:
        if self._indexes:
            threading.Thread(target=self._watch, name="nvml-xid", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        with nvml_session() as pynvml:
            if pynvml is None:
                return
            try:
                events = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                logger.warning("NVML events unavailable, no XID counts: %s", exc)
                return
            handles = {}
            for index in self._indexes:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
                    handles[_text(pynvml.nvmlDeviceGetUUID(handle))] = index
                except pynvml.NVMLError as exc:
                    logger.warning("GPU %d cannot report XID events: %s", index, exc)
            try:
                while handles and not self._stop.is_set():
                    try:
                        data = pynvml.nvmlEventSetWait_v2(events, self.WAIT_MS)
                    except pynvml.NVMLError_Timeout:
                        continue
                    device = handles.get(_text(pynvml.nvmlDeviceGetUUID(data.device)))
                    if device is not None:
                        self.record(device, int(data.eventData))
            finally:
                pynvml.nvmlEventSetFree(events)


def metrics_registry(
    path: Path, statuses: Callable[[], list[SlotStatus]], xids: XidWatcher | None
) -> CollectorRegistry:
    """The host's registry: the slots' files, the launcher's GPUs and slots, vLLM's snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SlotMetricsCollector(path))
    registry.register(HostCollector(statuses, xids))
    registry.register(VllmCollector(path))
    return registry


class VllmCollector(Collector):
    """vLLM's statistics from the slots' snapshots, under vLLM's names, with the slot's labels."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def collect(self) -> Iterator[Metric]:
        yield from read_vllm_snapshots(self._path)


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def guarded_app(app: WsgiApp, token: str) -> WsgiApp:
    """`app` behind the bearer `token` (none: open), with an open `/healthz` beside it."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if token and not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required (BATCHERY_METRICS_TOKEN)\n"]
        return app(environ, start_response)

    return guarded


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape, as prometheus_client's own server; they never hold the launcher's exit."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not news."""


def serve_metrics(registry: CollectorRegistry, *, port: int, address: str, token: str = "") -> bool:
    """Serve `registry` on http://address:port/metrics from a thread, behind `token` when one is set;
    False (logged) if the port is taken.

    A port in use must not keep the host's GPUs from working; the scrape target shows it as down.
    prometheus_client's `start_http_server` asks for no token, so its WSGI app is served here behind one.
    """
    try:
        family = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (_Server,), {"address_family": family})
        app = guarded_app(make_wsgi_app(registry), token)
        server: WSGIServer = make_server(address, port, app, server_class, handler_class=_QuietHandler)
    except OSError as exc:
        logger.error("metrics not served on %s:%d: %s", address, port, exc)
        return False
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    logger.info("metrics on http://%s:%d/metrics%s", address, port, " (bearer token)" if token else "")
    return True
