"""GPU hosts as the fleet runs them: launchers with only the broker's and the store's addresses.

`network` builds a small network of its own, as root: one network namespace per GPU host, each
joined to this (the control) host by a veth pair on a /30 of a 10.213.x.0/24 block no interface
uses yet, and the control host's services listen on one address of that block kept on `lo`.
PostgreSQL stays on 127.0.0.1, which no namespace reaches. Every namespace, link and address is
removed at the end, and every process started is killed.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from portal.devstack.embedded import start_embedded_redis
from tests.chaos.conftest import ARTIFACTS, wait_consuming
from tests.ops.conftest import stack, stack_env  # noqa: F401  (fixtures of the test without namespaces)
from tests.support.chaos import CHAOS_ENV, ChaosStack
from tests.support.moto_server import running_moto_server
from tests.support.workers import REPO, database_url

HOSTS = ("a", "b", "c")


def run_ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass(frozen=True)
class GpuHost:
    """A GPU machine: a network namespace with its own hostname, linked to the control host."""

    hostname: str
    netns: str
    host_veth: str
    """The control host's end of the link; set down, it cuts this machine off."""


@dataclass
class HostNetwork:
    control_address: str
    """Where the control host's broker and S3 server listen, reached by every GPU host."""
    hosts: dict[str, GpuHost]

    def cut(self, host: GpuHost) -> None:
        run_ip("link", "set", host.host_veth, "down")


def _free_block() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-o", "-4", "addr"], check=True, capture_output=True, text=True).stdout
    for third in random.sample(range(254), 254):
        block = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if f"10.213.{third}." not in used:
            return block
    raise RuntimeError("no free 10.213.x.0/24 block for the test network")


def _refusal(probe: str) -> str | None:
    """Why network namespaces cannot be made here (not root, a kernel without them); None if they can."""
    try:
        run_ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return getattr(exc, "stderr", None) or str(exc)
    run_ip("netns", "del", probe)
    return None


@pytest.fixture
def network() -> Iterator[HostNetwork]:
    tag = f"{os.getpid() % 10000:04d}"
    refused = _refusal(f"batchery-probe-{tag}")
    if refused is not None:
        pytest.skip(f"the kernel refuses network namespaces here (ip netns add: {refused.strip()})")
    block = _free_block()
    addresses = list(block.hosts())
    control = str(addresses[-1])
    hosts: dict[str, GpuHost] = {}
    try:
        run_ip("addr", "add", f"{control}/32", "dev", "lo")
        for n, name in enumerate(HOSTS):
            host = GpuHost(hostname=f"gpu-{name}-{tag}", netns=f"batchery-{name}-{tag}", host_veth=f"bn{tag}{name}h")
            hosts[name] = host
            inner = f"bn{tag}{name}n"
            near, far = addresses[4 * n], addresses[4 * n + 1]
            run_ip("netns", "add", host.netns)
            run_ip("link", "add", host.host_veth, "type", "veth", "peer", "name", inner)
            run_ip("link", "set", inner, "netns", host.netns)
            run_ip("addr", "add", f"{near}/30", "dev", host.host_veth)
            run_ip("link", "set", host.host_veth, "up")
            for command in (
                ["addr", "add", f"{far}/30", "dev", inner],
                ["link", "set", inner, "up"],
                ["link", "set", "lo", "up"],
                ["route", "add", "default", "via", str(near)],
            ):
                run_ip("netns", "exec", host.netns, "ip", *command)
        yield HostNetwork(control_address=control, hosts=hosts)
    finally:
        for host in hosts.values():
            for command in (["link", "del", host.host_veth], ["netns", "del", host.netns]):
                subprocess.run(["ip", *command], capture_output=True, timeout=10)
        subprocess.run(["ip", "addr", "del", f"{control}/32", "dev", "lo"], capture_output=True, timeout=10)


def host_env(*, broker_url: str, storage_url: str, s3_env: dict[str, str]) -> dict[str, str]:
    """All a GPU host's launcher is given: the broker, the store, and the short timeouts of the chaos
    tests (a visibility timeout of seconds, so a lost shard comes back within the test)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CELERY_BROKER_URL": broker_url,
        "CELERY_RESULT_BACKEND": broker_url,
        "BATCHERY_STORAGE_URL": storage_url,
        **s3_env,
        **CHAOS_ENV,
        "BATCHERY_HEARTBEAT_INTERVAL_S": "1",
    }


class HostLauncher:
    """`python -m gpuworkers launch` with exactly `env`, in a namespace under its own hostname or here."""

    def __init__(self, name: str, env: dict[str, str], *, log_dir: Path, host: GpuHost | None = None) -> None:
        self.log_path = log_dir / f"launcher-{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        launch = [sys.executable, "-m", "gpuworkers", "launch", "--cpu-slots", "1", "--metrics-port", "0"]
        command = ["env", "-i", *(f"{key}={value}" for key, value in env.items()), *launch]
        if host is not None:
            # A UTS namespace gives the machine its own hostname, which names its slots' workers.
            set_hostname = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host.hostname]
            command = ["ip", "netns", "exec", host.netns, *set_hostname, *command]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def launchers() -> Iterator[list[HostLauncher]]:
    """Launchers a test starts (append them); all killed at the end, before the namespaces go."""
    started: list[HostLauncher] = []
    yield started
    for launcher in started:
        launcher.stop()


@pytest.fixture
def log_dir(request: pytest.FixtureRequest) -> Path:
    path = ARTIFACTS / "network-logs" / request.node.name
    # Logs are appended to: start empty, so that a test reads only the lines of its own run.
    shutil.rmtree(path, ignore_errors=True)
    return path


@dataclass(frozen=True)
class ControlServices:
    """The control host's side of the fleet: the stack (Redis, control worker with beat, the test
    database) and an S3 server, each listening where the GPU hosts reach it."""

    stack: ChaosStack
    broker_url: str
    """The broker as the GPU hosts address it."""
    storage_url: str
    s3_env: dict[str, str]


@pytest.fixture
def control_services(
    transactional_db: None, network: HostNetwork, tmp_path: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ControlServices]:
    from django.db import connection

    from tasks.shared.storage import registry
    from tasks.shared.storage.s3 import S3Store

    with running_moto_server(host=network.control_address) as s3_url:
        s3_env = {
            "AWS_ENDPOINT_URL": s3_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # Keep the machine's own AWS set-up out of the test.
            "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"),
        }
        bucket = f"batchery-{uuid.uuid4().hex[:10]}"
        storage_url = f"s3://{bucket}/batchery"
        # This process sets the store up and reads the job's output from it.
        for name, value in {**s3_env, "BATCHERY_STORAGE_URL": storage_url}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(registry, "_S3", S3Store())
        boto3.client("s3").create_bucket(Bucket=bucket)
        env = {
            **os.environ,
            **CHAOS_ENV,
            "DATABASE_URL": database_url(connection.settings_dict),
            "DJANGO_SETTINGS_MODULE": "portal.settings",
        }
        stack = ChaosStack(env=env, data_dir=tmp_path / "control", log_dir=log_dir)
        stack.redis = start_embedded_redis(stack.data_dir / "redis", also_bind=[network.control_address])
        stack.env["CELERY_BROKER_URL"] = stack.env["CELERY_RESULT_BACKEND"] = stack.redis.url
        try:
            stack.start_control()
            wait_consuming(stack)
            yield ControlServices(
                stack=stack,
                broker_url=f"redis://{network.control_address}:{stack.redis.port}/0",
                storage_url=storage_url,
                s3_env=s3_env,
            )
        finally:
            stack.stop()
