"""The launcher's registry: multiprocess files of live and dead slot processes, vLLM's snapshots, NVML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuworkers.metrics_server import SlotStatus, metrics_registry, prepare_metrics_dir, sweep_dead_processes
from gpuworkers.slots import Slot
from gpuworkers.vllm_metrics import snapshot_entries

CHILD = """
from gpuworkers import metrics
metrics.SLOT_RECORDS.labels(*metrics.model_labels("m"), "succeeded").inc({records})
metrics.MODEL_CACHE_BYTES.labels(*metrics.slot_labels()).set(1000)
"""


def _samples(registry: CollectorRegistry) -> dict[str, list[Any]]:
    text = generate_latest(registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _registry(path: Path, statuses: list[SlotStatus] | None = None) -> CollectorRegistry:
    return metrics_registry(path, lambda: statuses or [], None)


def test_counts_of_exited_processes_stay_and_their_live_gauges_go(tmp_path: Path) -> None:
    directory = prepare_metrics_dir(tmp_path / "mp")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "BATCHERY_SLOT": "0"}
    for records in (3, 4):
        subprocess.run([sys.executable, "-c", CHILD.format(records=records)], env=env, check=True)
    samples = _samples(_registry(directory))
    assert sum(s.value for s in samples["batchery_slot_records"] if s.name.endswith("_total")) == 7
    assert sum(s.value for s in samples["batchery_model_cache_bytes"]) == 2000, "not yet swept"
    assert len(sweep_dead_processes(directory)) == 2
    samples = _samples(_registry(directory))
    assert sum(s.value for s in samples["batchery_slot_records"] if s.name.endswith("_total")) == 7
    assert not samples["batchery_model_cache_bytes"], "a dead process holds no model"


def test_every_slot_metric_is_described_before_its_first_sample(tmp_path: Path) -> None:
    names = set(_samples(_registry(prepare_metrics_dir(tmp_path / "mp"))))
    assert {"batchery_slot_busy_seconds", "batchery_shard_duration_seconds", "batchery_model_load_failures"} <= names


class _Snapshot:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _vllm_type(name: str) -> type:
    return type(name, (_Snapshot,), {})


def test_vllm_statistics_are_served_under_vllms_names_with_the_slots_labels(tmp_path: Path) -> None:
    counter, gauge, histogram, vector = (_vllm_type(n) for n in ("Counter", "Gauge", "Histogram", "Vector"))
    entries = snapshot_entries(
        [
            counter(name="vllm:prompt_tokens", labels={"model_name": "m"}, value=42),
            gauge(name="vllm:num_requests_running", labels={"model_name": "m"}, value=3.0),
            histogram(
                name="vllm:e2e_request_latency_seconds", labels={"model_name": "m"}, count=4, sum=2.0,
                buckets={"0.5": 1, "1.0": 3, "+Inf": 4},
            ),
            vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={"model_name": "m"}, values=[5, 2]),
        ]
    )  # fmt: skip
    directory = prepare_metrics_dir(tmp_path / "mp")
    (directory / f"vllm_{os.getpid()}.json").write_text(json.dumps({"slot": ["h", "0", "h100"], "metrics": entries}))
    samples = _samples(_registry(directory))
    (tokens,) = samples["vllm:prompt_tokens"]
    assert (tokens.name, tokens.value, tokens.labels["slot"], tokens.labels["model_name"]) == (
        "vllm:prompt_tokens_total", 42, "0", "m",
    )  # fmt: skip
    buckets = {s.labels["le"]: s.value for s in samples["vllm:e2e_request_latency_seconds"] if "le" in s.labels}
    assert buckets == {"0.5": 1, "1.0": 3, "+Inf": 4}
    assert [s.value for s in samples["vllm:spec_decode_num_accepted_tokens_per_pos"] if s.name.endswith("_total")] == [
        5, 2,
    ]  # fmt: skip


class _NvmlError(Exception):
    pass


def _fake_pynvml() -> types.ModuleType:
    """NVML as pynvml exposes it, for one H100; no GPU exists on the machines the tests run on."""
    module = types.ModuleType("pynvml")
    module.NVMLError = _NvmlError  # type: ignore[attr-defined]
    module.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    calls: dict[str, Any] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetHandleByIndex": lambda index: f"handle-{index}",
        "nvmlDeviceGetUtilizationRates": lambda handle: types.SimpleNamespace(gpu=87),
        "nvmlDeviceGetMemoryInfo": lambda handle: types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30),
        "nvmlDeviceGetTemperature": lambda handle, sensor: 61,
        "nvmlDeviceGetPowerUsage": lambda handle: 350_000,
        "nvmlDeviceGetUUID": lambda handle: "GPU-1234",
        "nvmlDeviceGetName": lambda handle: b"NVIDIA H100 80GB HBM3",
    }
    for name, call in calls.items():
        setattr(module, name, call)
    return module


def test_each_gpu_is_read_from_nvml_with_dcgm_exporters_labels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    slot = Slot(index=0, gpu_class="h100-80gb", gpus=(3,), torch_threads=0)
    samples = _samples(_registry(prepare_metrics_dir(tmp_path / "mp"), [SlotStatus(slot=slot, up=True, restarts=2)]))
    (utilization,) = samples["batchery_gpu_utilization_ratio"]
    assert utilization.value == pytest.approx(0.87)
    assert {k: utilization.labels[k] for k in ("gpu", "UUID", "modelName", "gpu_class", "slot")} == {
        "gpu": "3", "UUID": "GPU-1234", "modelName": "NVIDIA H100 80GB HBM3", "gpu_class": "h100-80gb", "slot": "0",
    }  # fmt: skip
    assert samples["batchery_gpu_power_watts"][0].value == 350.0
    assert samples["batchery_gpu_memory_total_bytes"][0].value == 80 * 2**30
    assert samples["batchery_slot_up"][0].value == 1.0
    assert [s.value for s in samples["batchery_slot_restarts"] if s.name.endswith("_total")] == [2.0]
