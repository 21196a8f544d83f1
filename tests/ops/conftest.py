"""Fixtures of the ops tests: a stack with its own Redis and control worker, and launchers on it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from portal.devstack.embedded import free_port
from tests.chaos.conftest import ARTIFACTS, wait_consuming
from tests.support.chaos import CHAOS_ENV, ChaosStack, wait_for
from tests.support.workers import REPO, database_url, newcomer_env


class Launcher:
    def __init__(self, stack: ChaosStack, name: str, *args: str) -> None:
        self.log_path = stack.log_dir / f"launcher-{name}.log"
        stack.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**stack.env, "BATCHERY_HEARTBEAT_INTERVAL_S": "1"}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpuworkers", "launch", *args], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def worker_pids(self) -> set[int]:
        return {child.pid for child in psutil.Process(self.process.pid).children(recursive=True)}

    def slot_masters(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def stack_env() -> dict[str, str]:
    """What every process of the test's stack gets on top of the chaos settings; a test module overrides it."""
    return {}


@pytest.fixture
def stack(
    transactional_db: None, tmp_path: Path, request: pytest.FixtureRequest, stack_env: dict[str, str]
) -> Iterator[ChaosStack]:
    from django.db import connection

    env = {**os.environ, **CHAOS_ENV, "DATABASE_URL": database_url(connection.settings_dict), **stack_env}
    log_dir = ARTIFACTS / "fleet-logs" / request.node.name
    # Logs are appended to: start empty, so that a test reads only the lines of its own run.
    shutil.rmtree(log_dir, ignore_errors=True)
    stack = ChaosStack(env=env, data_dir=tmp_path / "fleet", log_dir=log_dir)
    stack.start_redis()
    try:
        stack.start_control()
        wait_consuming(stack)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def launch(stack: ChaosStack) -> Iterator[Callable[..., Launcher]]:
    launchers: list[Launcher] = []

    def start(name: str, *args: str) -> Launcher:
        launcher = Launcher(stack, name, *args)
        launchers.append(launcher)
        return launcher

    yield start
    for launcher in launchers:
        launcher.stop()


def wait_slots(stack: ChaosStack, count: int) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(stack.broker_url)

    def beats() -> list[dict[str, Any]] | None:
        values = [json.loads(client.get(key) or b"null") for key in client.scan_iter(match="batchery:fleet:*")]
        return values if len([v for v in values if v]) >= count else None

    result: list[dict[str, Any]] = wait_for(beats, timeout_s=90, what=f"{count} slot heartbeats", stack=stack)
    return result


def stop_process_group(process: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """SIGTERM to the process's group, SIGKILL if it is still there after `timeout_s`."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass
class UpProcess:
    """`manage.py up` running in its own process group."""

    process: subprocess.Popen[bytes]
    portal_port: int
    flower_port: int
    log_path: Path
    var_dir: Path

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:]


@pytest.fixture
def up_without_services(tmp_path: Path) -> Iterator[UpProcess]:
    """`manage.py up` with no broker, database or Flower auth configured: embedded Redis and SQLite."""
    env = {name: value for name, value in newcomer_env(tmp_path / "var").items() if not name.startswith("FLOWER_")}
    portal_port, flower_port = free_port(), free_port()
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--address", f"127.0.0.1:{portal_port}",
             "--flower-port", str(flower_port), "--cpu-slots", "1", "--loglevel", "WARNING"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    up = UpProcess(process, portal_port, flower_port, log_path, tmp_path / "var")
    try:
        yield up
    finally:
        stop_process_group(process, timeout_s=60)
