"""`manage.py up` stops within seconds, on SIGTERM as on Ctrl-C, and its parts never outlive it: a running
shard goes back to the queue and runs again, once, at the next start; where `up` is killed outright, its
parts stop by themselves (the kernel tells each that its parent died) and the next start finishes the job
with every record once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import orjson
import psutil
import pytest
import redis

from portal.devstack.embedded import free_port
from tests.ops.conftest import UpProcess, stop_process_group
from tests.support.workers import REPO, newcomer_env

pytestmark = pytest.mark.slow

RECORDS = 1200
SHARD_SIZE = 400


def _env(var_dir: Path) -> dict[str, str]:
    return {name: value for name, value in newcomer_env(var_dir).items() if not name.startswith("FLOWER_")}


def _start(var_dir: Path, log_path: Path) -> UpProcess:
    portal_port, flower_port = free_port(), free_port()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--address", f"127.0.0.1:{portal_port}",
             "--flower-port", str(flower_port), "--cpu-slots", "1", "--loglevel", "WARNING"],
            cwd=REPO, env=_env(var_dir), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return UpProcess(process, portal_port, flower_port, log_path, var_dir)


def _broker(up: UpProcess, *, runs: int, timeout_s: float = 240) -> str:
    """The broker the `runs`-th start of `up` in this log printed, once it is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert up.process.poll() is None, up.log_tail()
        found = re.findall(r"broker (redis://\S+?)\. Ctrl-C", up.log_path.read_text())
        if len(found) >= runs:
            return str(found[runs - 1])
        time.sleep(0.5)
    raise AssertionError(f"up did not come up: {up.log_tail()}")


def _submit(var_dir: Path, broker: str, records: int) -> str:
    path = var_dir.parent / "input.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"custom_id": f"r{n}", "input": f"sentence {n} " * 12}) + b"\n"
                              for n in range(records)))  # fmt: skip
    env = {**_env(var_dir), "CELERY_BROKER_URL": broker, "CELERY_RESULT_BACKEND": broker}
    out = subprocess.run(
        [sys.executable, "manage.py", "submit", "--model", "all-MiniLM-L6-v2", "--input", str(path),
         "--shard-size", str(SHARD_SIZE)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=True,
    ).stdout  # fmt: skip
    match = re.search(r"job ([0-9a-f-]{36}) queued", out)
    assert match, out
    return match.group(1)


def _wait_for_a_running_shard(broker: str, job_id: str, up: UpProcess, timeout_s: float = 300) -> None:
    client = redis.Redis.from_url(broker)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert up.process.poll() is None, up.log_tail()
        if client.keys(f"batchery:lease:shard:{job_id}:*"):
            return
        time.sleep(0.2)
    raise AssertionError(f"no shard of job {job_id} ran within {timeout_s:.0f}s: {up.log_tail()}")


def _job(var_dir: Path, job_id: str) -> tuple[str, str]:
    with sqlite3.connect(f"file:{var_dir / 'batchery.sqlite3'}?mode=ro", uri=True, timeout=10) as db:
        row = db.execute("select status, output_uri from jobs_job where id = ?", (job_id.replace("-", ""),)).fetchone()
    assert row is not None
    return str(row[0]), str(row[1] or "")


def _every_record_once(var_dir: Path, job_id: str, up: UpProcess, timeout_s: float = 420) -> None:
    deadline = time.monotonic() + timeout_s
    status = ""
    while time.monotonic() < deadline:
        assert up.process.poll() is None, up.log_tail()
        status, output_uri = _job(var_dir, job_id)
        if status in ("succeeded", "partially_succeeded", "failed"):
            break
        time.sleep(1)
    assert status == "succeeded", f"job {job_id} is {status}: {up.log_tail()}"
    lines = [orjson.loads(line) for line in Path(urlparse(output_uri).path).read_bytes().splitlines()]
    counts = Counter(line["custom_id"] for line in lines)
    assert len(lines) == RECORDS and set(counts.values()) == {1}, "every record exactly once"
    assert all("response" in line for line in lines)


def _parts(up: UpProcess) -> list[psutil.Process]:
    return psutil.Process(up.process.pid).children(recursive=True)


def _alive(processes: list[psutil.Process]) -> list[str]:
    _, alive = psutil.wait_procs(processes, timeout=0)
    return [f"{process.pid} {' '.join(process.cmdline()[:4])}" for process in alive if _not_zombie(process)]


def _kill_leftovers(parts: list[psutil.Process]) -> None:
    """What a failed test left running, killed: it would hold the next stack's ports."""
    for process in parts:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _not_zombie(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass(frozen=True)
class Interrupted:
    """A `manage.py up` caught while a shard of its job runs."""

    up: UpProcess
    job_id: str
    parts: list[psutil.Process]


@contextlib.contextmanager
def _up_running_a_shard(var_dir: Path, log_path: Path) -> Iterator[Interrupted]:
    """`manage.py up` with a job whose shard is running; whatever the block leaves of it is ended after it."""
    up = _start(var_dir, log_path)
    parts: list[psutil.Process] = []
    try:
        broker = _broker(up, runs=1)
        job_id = _submit(var_dir, broker, RECORDS)
        _wait_for_a_running_shard(broker, job_id, up)
        parts = _parts(up)
        yield Interrupted(up=up, job_id=job_id, parts=parts)
    finally:
        stop_process_group(up.process, timeout_s=5)
        _kill_leftovers(parts)


def _the_next_start_finishes(var_dir: Path, log_path: Path, job_id: str) -> None:
    """Start `up` again on the same folder: the interrupted job ends with every record exactly once."""
    again = _start(var_dir, log_path)
    try:
        _broker(again, runs=2)
        _every_record_once(var_dir, job_id, again)
    finally:
        stop_process_group(again.process, timeout_s=30)


def test_sigterm_stops_up_within_seconds_and_the_interrupted_shard_runs_again_once_at_the_next_start(
    tmp_path: Path,
) -> None:
    var_dir = tmp_path / "var"
    log_path = var_dir.parent / "up.log"
    with _up_running_a_shard(var_dir, log_path) as running:
        started = time.monotonic()
        running.up.process.send_signal(signal.SIGTERM)
        running.up.process.wait(timeout=30)
        took = time.monotonic() - started

        assert took < 8, f"up took {took:.1f}s to stop: {running.up.log_tail()}"
        assert running.up.process.returncode == 0, running.up.log_tail()
        assert _alive(running.parts) == [], "no part outlives up"

    _the_next_start_finishes(var_dir, log_path, running.job_id)


def test_the_parts_of_a_killed_up_stop_by_themselves_and_the_next_start_finishes_its_job(tmp_path: Path) -> None:
    var_dir = tmp_path / "var"
    log_path = var_dir.parent / "up.log"
    with _up_running_a_shard(var_dir, log_path) as running:
        parts = running.parts
        assert any("flower" in " ".join(part.cmdline()) for part in parts), "Flower, which a leftover blocked"

        os.kill(running.up.process.pid, signal.SIGKILL)
        running.up.process.wait()

        # A slot's cold shutdown may wait on the embedded Redis, gone with the rest: its launcher's drain
        # bound (gpuworkers.launcher.DRAIN_GRACE_S, no soft shutdown here) ends it. The message it could not
        # give back is put back on its queue by the next start (not after the visibility timeout).
        _, alive = psutil.wait_procs(parts, timeout=30)
        assert [process for process in alive if _not_zombie(process)] == [], _alive(parts)

    _the_next_start_finishes(var_dir, log_path, running.job_id)
