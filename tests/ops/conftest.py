"""Fixtures of the ops tests: a stack with its own Redis and control worker, and launchers on it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.chaos.conftest import ARTIFACTS, wait_consuming
from tests.support.chaos import CHAOS_ENV, ChaosStack
from tests.support.workers import REPO, database_url


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
def stack(transactional_db: None, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ChaosStack]:
    from django.db import connection

    env = {**os.environ, **CHAOS_ENV, "DATABASE_URL": database_url(connection.settings_dict)}
    stack = ChaosStack(env=env, data_dir=tmp_path / "fleet", log_dir=ARTIFACTS / "fleet-logs" / request.node.name)
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
