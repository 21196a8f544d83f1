"""GPU hosts that have only the broker and the store: no Django in their slots, no database, and
over a real network (namespaces linked by veth pairs), shards of one job on several machines, one
of them cut off mid-job."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis
from celery import Celery

from portal.jobs.models import Job
from tests.factories import ModelFactory, TenantFactory
from tests.network.conftest import ControlServices, HostLauncher, HostNetwork, host_env
from tests.support.chaos import ChaosStack, check_exactly_once, wait_for, write_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Nothing listens there: a slot that tried the database would fail, not find one.
CLOSED_DATABASE_URL = "postgres://batchery@127.0.0.1:9/nothing"


def _echo_model(*, sleep_per_record: float) -> None:
    ModelFactory(
        name="net-echo", engine="python", task="classify", is_default=False,
        source="tests.support.chaos_engines:echo_factory",
        default_params={"sleep_per_record": sleep_per_record, "time_limit_base_s": 10 + 20 * sleep_per_record},
    )  # fmt: skip


def _heartbeats(broker_url: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(broker_url)
    return [json.loads(value) for key in client.scan_iter(match="batchery:fleet:*") if (value := client.get(key))]


def _wait_hosts(stack: ChaosStack, broker_url: str, hosts: set[str]) -> list[dict[str, Any]]:
    def beats() -> list[dict[str, Any]] | None:
        found = _heartbeats(broker_url)
        return found if hosts <= {beat["host"] for beat in found} else None

    found: list[dict[str, Any]] = wait_for(beats, timeout_s=90, what=f"slots of {sorted(hosts)}", stack=stack)
    return found


def _finished(stack: ChaosStack, job_id: str, *, timeout_s: float) -> Job:
    job: Job = wait_for(
        lambda: (j := Job.objects.get(pk=job_id)).is_finished and j, timeout_s=timeout_s, what="job", stack=stack
    )
    return job


def test_a_gpu_host_imports_no_django_and_runs_a_job_with_no_database_reachable(
    stack: ChaosStack, launchers: list[HostLauncher], log_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        **host_env(broker_url=stack.broker_url, storage_url=stack.env["BATCHERY_STORAGE_URL"], s3_env={}),
        "DATABASE_URL": CLOSED_DATABASE_URL,
    }
    assert "DJANGO_SETTINGS_MODULE" not in env
    launcher = HostLauncher("no-django", env, log_dir=log_dir)
    launchers.append(launcher)
    (beat,) = _wait_hosts(stack, stack.broker_url, {socket.gethostname()})
    # Celery prefers these variables over a URL given in code; point them at this stack's Redis.
    monkeypatch.setenv("CELERY_BROKER_URL", stack.broker_url)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", stack.broker_url)
    app = Celery(broker=stack.broker_url, backend=stack.broker_url)
    info = app.send_task("batchery.slot_info", queue="gpu.cpu").get(timeout=30)
    assert info["hostname"] == beat["worker"]
    assert info["django_imported"] is False, "the slot process has no django module loaded"
    registered = (app.control.inspect(destination=[beat["worker"]], timeout=5).registered() or {})[beat["worker"]]
    assert sorted(registered) == ["batchery.run_shard", "batchery.run_shards", "batchery.slot_info"], (
        "only the slot's tasks"
    )

    # The control worker (Django, the database) plans and merges; the slot runs every shard.
    _echo_model(sleep_per_record=0.0)
    ids = write_records(tmp_path / "in.jsonl", [f"record {n}" for n in range(30)])
    job_id = stack.submit(model="net-echo", input_path=tmp_path / "in.jsonl", shard_size=10)
    job = _finished(stack, job_id, timeout_s=90)
    check_exactly_once("a GPU host without Django", job, ids, 0)
    assert job.status == "succeeded", job.error
    assert set(job.shards.values_list("worker", flat=True)) == {beat["worker"]}
    assert launcher.process.poll() is None, launcher.log_tail()


def test_shards_of_one_job_run_on_two_hosts_over_the_network_and_a_host_cut_off_loses_its_shard(
    network: HostNetwork, control_services: ControlServices, launchers: list[HostLauncher], log_dir: Path
) -> None:
    services, stack = control_services, control_services.stack
    env = host_env(broker_url=services.broker_url, storage_url=services.storage_url, s3_env=services.s3_env)
    for name, host in network.hosts.items():
        launchers.append(HostLauncher(name, env, log_dir=log_dir, host=host))
    names = {name: host.hostname for name, host in network.hosts.items()}
    _wait_hosts(stack, stack.broker_url, set(names.values()))

    bucket = services.storage_url.removeprefix("s3://").split("/")[0]
    ids = [f"rec-{n:06d}" for n in range(200)]
    body = "".join(json.dumps({"custom_id": i, "input": f"record {i}"}) + "\n" for i in ids)
    s3 = boto3.client("s3")
    s3.put_object(Bucket=bucket, Key="datasets/in.jsonl", Body=body.encode())
    TenantFactory(name="net", storage_prefixes=[f"s3://{bucket}/datasets/"])
    # Shards of 20 records at 0.25 s each: about 5 s, long enough to cut a host in the middle of one.
    _echo_model(sleep_per_record=0.25)
    started = time.monotonic()
    job_id = stack.submit(model="net-echo", input_path=f"s3://{bucket}/datasets/in.jsonl", shard_size=20, tenant="net")

    def shard_on_c() -> str | None:
        return next((b["current_shard"] for b in _heartbeats(stack.broker_url) if b["host"] == names["c"]), None)

    lost: str = wait_for(shard_on_c, timeout_s=60, what="a shard on host c", stack=stack)
    network.cut(network.hosts["c"])

    job = _finished(stack, job_id, timeout_s=180)
    check_exactly_once("a GPU host cut off mid-job", job, ids, time.monotonic() - started)
    assert job.status == "succeeded", job.error
    workers = dict(job.shards.values_list("index", "worker"))
    hosts = {worker.split("@", 1)[1] for worker in workers.values()}
    assert {names["a"], names["b"]} <= hosts, f"shards ran on both remaining hosts: {workers}"
    lost_index = int(lost.rsplit("/", 1)[1])
    assert not workers[lost_index].endswith(f"@{names['c']}"), "the cut-off host's shard was run again elsewhere"
