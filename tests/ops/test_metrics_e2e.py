"""Monitoring end to end: a real Prometheus scrapes a live portal and a live launcher of two slots.

One stack serves every check, since each needs the same processes: the figures Prometheus shows after
a job, counts that stay right under prefork when a pool child is replaced, and every metric that the
shipped alert rules and dashboard use existing in the live /metrics output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from portal.devstack.embedded import free_port
from portal.jobs.models import Job
from tests.factories import ModelFactory
from tests.ops.conftest import Launcher
from tests.support.chaos import ChaosStack, check_exactly_once, wait_for, write_records
from tests.support.metric_names import referenced_metric_names
from tests.support.workers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RECORDS = 120
SHARD_SIZE = 10
# The launcher's series only: the live portal is this pytest process, whose default registry also holds
# the slot metrics that earlier in-process tests of the session counted into.
HOST = '{job="batchery-gpuworkers"}'


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed `name{label="value",...}` with labels sorted."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def family_names(url: str) -> set[str]:
    """The metric names a /metrics page declares (`# TYPE` lines, counters with their `_total`)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(f"{name}_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def slots_up(url: str) -> float:
    try:
        return total(scrape(url), "batchery_slot_up")
    except OSError:
        return 0.0


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(value for key, value in samples.items() if key.split("{")[0] == name and all(w in key for w in wanted))


@dataclass
class PrometheusServer:
    process: subprocess.Popen[bytes]
    url: str

    def query(self, promql: str) -> float | None:
        """The single value of an instant query, or None when it has no result."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(address, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        result = body["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for_value(self, promql: str, predicate: Callable[[float | None], bool], timeout_s: float = 30) -> float:
        deadline = time.monotonic() + timeout_s
        value = self.query(promql)
        while not predicate(value):
            assert time.monotonic() < deadline, f"{promql} stayed {value}"
            time.sleep(0.5)
            value = self.query(promql)
        assert value is not None
        return value


@pytest.fixture
def stack_env() -> dict[str, str]:
    """No speculative copies of the last shard: the host's record counts must equal the job's, and a
    copy's partial work counts as work done (it is)."""
    return {"BATCHERY_SPECULATION": "false"}


@pytest.fixture
def prometheus(tmp_path: Path, live_server: Any) -> Callable[[str], PrometheusServer]:
    started: list[subprocess.Popen[bytes]] = []

    def start(launcher_target: str) -> PrometheusServer:
        binary = "/usr/bin/prometheus"
        if not Path(binary).exists():
            pytest.skip("Debian's prometheus package is not installed (.ci/run installs it)")
        portal = urllib.parse.urlsplit(live_server.url).netloc
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "batchery-portal", "static_configs": [{"targets": [portal]}]},
                {"job_name": "batchery-gpuworkers", "static_configs": [{"targets": [launcher_target]}]},
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = (tmp_path / "prometheus.log").open("wb")
        process = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        started.append(process)
        server = PrometheusServer(process=process, url=f"http://127.0.0.1:{port}")
        wait_for(lambda: _ready(server.url), timeout_s=30, what="Prometheus to be ready")
        return server

    yield start  # type: ignore[misc]
    for process in started:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture
def portal_reads_stack(stack: ChaosStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The live portal (this process) reads the stack's Redis, as a deployed portal reads its broker."""
    monkeypatch.setenv("CELERY_BROKER_URL", stack.broker_url)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", stack.broker_url)


def test_prometheus_sees_a_job_on_a_two_slot_launcher_and_every_rule_and_panel_metric_exists(
    stack: ChaosStack,
    launch: Callable[..., Launcher],
    prometheus: Callable[[str], PrometheusServer],
    portal_reads_stack: None,
    live_server: Any,
    tmp_path: Path,
) -> None:
    ModelFactory(
        name="metrics-echo", engine="python", task="classify", is_default=False,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": 0.02, "micro_batch_size": 5, "time_limit_base_s": 20},
    )  # fmt: skip
    metrics_port = free_port()
    launcher = launch(
        "metrics", "--cpu-slots", "2", "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1"
    )
    host_url = f"http://127.0.0.1:{metrics_port}/metrics"
    portal_url = f"{live_server.url}/metrics"
    wait_for(lambda: slots_up(host_url) == 2, timeout_s=90, what="two slots up", stack=stack)
    server = prometheus(f"127.0.0.1:{metrics_port}")
    server.wait_for_value('count(up{job=~"batchery-.*"} == 1)', lambda value: value == 2)
    assert server.query("sum(batchery_records_finished_total)") in (None, 0.0)
    busy_before = server.query(f"sum(batchery_slot_busy_seconds_total{HOST})") or 0.0

    ids = write_records(tmp_path / "in.jsonl", [f"record {n}" for n in range(RECORDS)])
    job_id = stack.submit(model="metrics-echo", input_path=tmp_path / "in.jsonl", shard_size=SHARD_SIZE)
    job = wait_for(lambda: (j := Job.objects.get(pk=job_id)).is_finished and j, timeout_s=120, what="job", stack=stack)
    check_exactly_once("metrics", job, ids, 0)
    assert job.status == "succeeded"
    workers = set(job.shards.values_list("worker", flat=True))
    assert len(workers) == 2, f"the shards ran on both slots: {workers}"

    # What Prometheus shows after the job: the records counter rose by exactly the job's records,
    # the shard duration histogram by its shards, and the slots were busy.
    records = server.wait_for_value("sum(batchery_records_finished_total)", lambda value: value == RECORDS)
    assert records == RECORDS
    assert server.query('sum(batchery_records_finished_total{outcome="succeeded", model="metrics-echo"})') == RECORDS
    assert server.query('sum(batchery_jobs_finished_total{status="succeeded"})') == 1
    shards = server.wait_for_value(
        f"sum(batchery_shard_duration_seconds_count{HOST})", lambda value: value == job.shard_count
    )
    assert shards == job.shard_count == RECORDS // SHARD_SIZE
    busy = server.wait_for_value(
        f"sum(batchery_slot_busy_seconds_total{HOST})", lambda value: (value or 0) > busy_before
    )
    assert busy > busy_before
    # Each slot's counter reaches Prometheus at its own scrape: the sum above may rise on one slot's alone.
    both = server.wait_for_value(f"count(batchery_slot_busy_seconds_total{HOST} > 0)", lambda value: value == 2)
    assert both == 2, "both slots counted busy time"

    # Under prefork: the host's total is the job's record count, and stays so once a pool child that
    # counted records has exited and been replaced.
    host = scrape(host_url)
    assert total(host, "batchery_slot_records_total") == RECORDS
    assert total(host, "batchery_slot_records_total", outcome="succeeded") == RECORDS
    children = [child for master in launcher.slot_masters() for child in master.children()]
    assert len(children) == 2
    victim = children[0]
    victim.send_signal(signal.SIGKILL)
    wait_for(
        lambda: len({c.pid for m in launcher.slot_masters() for c in m.children()} - {victim.pid}) == 2,
        timeout_s=30, what="the pool to replace its child", stack=stack,
    )  # fmt: skip
    for _ in range(5):
        assert total(scrape(host_url), "batchery_slot_records_total") == RECORDS
        time.sleep(0.2)
    assert not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE

    # Every metric the alert rules and the dashboard use exists in the live output of this stack.
    live = family_names(host_url) | family_names(portal_url)
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    expressions = "\n".join(rule["expr"] for group in rules["groups"] for rule in group["rules"])
    dashboard = (REPO / "deploy/grafana/batchery.json").read_text()
    referenced = referenced_metric_names(expressions) | referenced_metric_names(dashboard)
    # vLLM's own statistics exist only on a slot running a vLLM model, which needs a GPU.
    missing = {name for name in referenced if not name.startswith("vllm:")} - live
    assert not missing, f"referenced but not exported: {sorted(missing)}"
