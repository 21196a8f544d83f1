"""The chaos harness: a whole Batchery stack in processes the test may kill, pause or restart.

Each stack has its own embedded Redis (so it can be stopped and started empty), control workers (the
first, `control`, runs beat, so the reconciler sweeps every couple of seconds; the others, `control2`
on, share the control queue with it, as a site scaled out runs them) and shard workers. Jobs are
submitted and cancelled through `manage.py`, like an operator would, against the test database.
The checker at the end is the same for every scenario: output and errors together hold the input ids, each
exactly once, in input order; one manifest per shard; one terminal transition.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from portal.devstack.embedded import EmbeddedRedis, start_embedded_redis
from portal.jobs.models import Job
from tasks.shared.storage import store_for
from tests.support.workers import REPO, WorkerProcess, start_worker, stop_workers

CHAOS_ENV = {
    "BATCHERY_RECONCILE_INTERVAL_S": "2",
    "BATCHERY_RECONCILE_STALE_AFTER_S": "6",
    "BATCHERY_LEASE_TTL_S": "3",
    "BATCHERY_SHARD_ATTEMPTS_BEFORE_BISECT": "2",
    "BATCHERY_SHARD_TIME_LIMIT_S": "20",
    "BATCHERY_VISIBILITY_TIMEOUT_S": "25",
}

CONTROL_WORKERS = int(os.environ.get("CHAOS_CONTROL_WORKERS", "2"))
"""Control worker processes of a chaos suite's stack: two by default, so that every scenario runs with
the control plane scaled out (one beat, several processes settling, scheduling and merging)."""


@dataclass
class ChaosStack:
    env: dict[str, str]
    data_dir: Path
    log_dir: Path
    redis: EmbeddedRedis | None = None
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    control_workers: int = 1
    """Control worker processes `start_control` starts: `control` with beat, `control2`... without."""

    @property
    def broker_url(self) -> str:
        assert self.redis is not None
        return self.redis.url

    def start_redis(self, port: int | None = None) -> None:
        self.redis = start_embedded_redis(self.data_dir / f"redis-{time.monotonic_ns()}", port=port)
        self.env["CELERY_BROKER_URL"] = self.env["CELERY_RESULT_BACKEND"] = self.redis.url

    def restart_redis_empty(self) -> None:
        assert self.redis is not None
        port = self.redis.port
        self.redis.process.kill()
        self.redis.process.wait()
        self.start_redis(port=port)

    def start_control(self) -> WorkerProcess:
        """The stack's control workers and its planning worker, `planning`; the first control worker,
        `control` (returned), runs the site's one beat."""
        worker = start_worker(
            "control", "control", env=self.env, log_dir=self.log_dir, extra_args=["--beat", "--schedule",
            str(self.data_dir / "beat-schedule")],
        )  # fmt: skip
        self.workers["control"] = worker
        # The others only where they are not running: a test may restart `control` alone.
        for name in self.control_names()[1:]:
            running = self.workers.get(name)
            if running is None or running.process.poll() is not None:
                queue = "planning" if name == "planning" else "control"
                self.workers[name] = start_worker(name, queue, env=self.env, log_dir=self.log_dir)
        return worker

    def control_names(self) -> list[str]:
        return ["control", *(f"control{n}" for n in range(2, self.control_workers + 1)), "planning"]

    def stop_control(self) -> None:
        """Stop every control worker and the planning worker (warm shutdown): nothing consumes the control
        and planning queues until `start_control`."""
        for name in self.control_names():
            self.workers[name].stop()

    def start_shard_worker(
        self,
        name: str = "cpu0",
        *,
        preload: str = "",
        extra_env: dict[str, str] | None = None,
        queue: str = "gpu.cpu",
    ) -> WorkerProcess:
        env = {**self.env, "CUDA_VISIBLE_DEVICES": "", "BATCHERY_PRELOAD": preload, **(extra_env or {})}
        worker = start_worker(name, queue, env=env, log_dir=self.log_dir)
        self.workers[name] = worker
        return worker

    def start_slots(
        self, count: int, *, first: int = 0, extra_env: dict[str, str] | None = None, queue: str = "gpu.cpu"
    ) -> list[WorkerProcess]:
        """`count` shard workers that announce themselves as slots of the `cpu` class (heartbeats, as
        the launcher's slots do), so that the scheduler sizes the queue's window from them. A slot
        started on another `queue` stands by until told to consume `gpu.cpu` (`app.control.add_consumer`)."""
        return [
            self.start_shard_worker(
                f"slot{n}",
                queue=queue,
                extra_env={
                    "BATCHERY_SLOT": str(n),
                    "BATCHERY_GPU_CLASS": "cpu",
                    "BATCHERY_QUEUE": "gpu.cpu",
                    "BATCHERY_WORKER_NAME": f"slot{n}@test",
                    **(extra_env or {}),
                },
            )
            for n in range(first, first + count)
        ]

    def pool_children(self, name: str) -> list[psutil.Process]:
        return psutil.Process(self.workers[name].process.pid).children()

    def manage(self, *args: str, timeout_s: float = 60) -> str:
        finished = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if finished.returncode != 0:
            raise AssertionError(f"manage.py {' '.join(args)} failed:\n{finished.stdout}\n{finished.stderr}")
        return finished.stdout

    def submit(
        self,
        *,
        model: str,
        input_path: Path | str,
        shard_size: int | None,
        tenant: str = "chaos",
        extra: tuple[str, ...] = (),
    ) -> str:
        """Submit through the CLI; no `shard_size` cuts by cost."""
        sizing = ("--shard-size", str(shard_size)) if shard_size is not None else ()
        out = self.manage(
            "submit", "--model", model, "--input", str(input_path), "--tenant", tenant, *sizing, *extra,
        )  # fmt: skip
        match = re.search(r"job ([0-9a-f-]{36}) queued", out)
        assert match, out
        return match.group(1)

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{worker.log_tail(60)}" for name, worker in self.workers.items())

    def stop(self) -> None:
        for worker in self.workers.values():
            if worker.process.poll() is None:
                for child in psutil.Process(worker.process.pid).children(recursive=True):
                    child.send_signal(signal.SIGCONT)
        stop_workers(self.workers.values(), timeout_s=10)
        if self.redis is not None:
            self.redis.stop()


def write_records(path: Path, texts: list[str]) -> list[str]:
    ids = [f"rec-{n:06d}" for n in range(len(texts))]
    path.write_bytes(
        b"".join(orjson.dumps({"custom_id": i, "input": t}) + b"\n" for i, t in zip(ids, texts, strict=True))
    )
    return ids


@dataclass(frozen=True)
class ChaosResult:
    scenario: str
    records_in: int
    out: int
    errors: int
    duplicates: int
    lost: int
    seconds: float
    status: str
    error_codes: dict[str, int]
    job_error: str = ""


def read_jsonl(uri: str) -> list[dict[str, Any]]:
    """The lines of an output or error file on local storage or S3; none where it is missing."""
    if uri.startswith("s3://"):
        store = store_for(uri)
        return [orjson.loads(line) for line in store.read_bytes(uri).splitlines()] if store.exists(uri) else []
    path = Path(uri.removeprefix("file://"))
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def check_exactly_once(scenario: str, job: Any, input_ids: list[str], seconds: float) -> ChaosResult:
    """The contract: every input id exactly once across output and errors, in order, one ending."""
    from portal.jobs.models import FINAL_STATUSES

    output = read_jsonl(job.output_uri)
    errors = read_jsonl(job.errors_uri)
    ids = [line["custom_id"] for line in output]
    counts = Counter(ids)
    duplicates = sum(count - 1 for count in counts.values() if count > 1)
    lost = len(set(input_ids) - set(ids))
    error_lines = [line for line in output if "error" in line]
    result = ChaosResult(
        scenario=scenario,
        records_in=len(input_ids),
        out=len(output),
        errors=len(errors),
        duplicates=duplicates,
        lost=lost,
        seconds=round(seconds, 1),
        status=job.status,
        error_codes=dict(Counter(line["error"]["code"] for line in errors)),
        job_error=job.error,
    )
    assert (duplicates, lost) == (0, 0), result
    assert ids == input_ids, "output lines are in input order, one per input record"
    assert [line["custom_id"] for line in errors] == [line["custom_id"] for line in error_lines]
    # One ending per run: a retry runs the job again, so count from its last start.
    events = list(job.events.values_list("status", flat=True))
    last_start = max((n for n, status in enumerate(events) if status == "running"), default=0)
    endings = [status for status in events[last_start:] if status in FINAL_STATUSES]
    assert endings == [job.status], f"one terminal transition, got {endings}"
    for shard in job.shards.all():
        commit = Path(shard.prefix_uri.removeprefix("file://")) / "commit.json"
        if commit.exists():
            assert orjson.loads(commit.read_bytes())["attempt_id"] == shard.attempt_id or job.status != "succeeded"
    return result


def wait_for(predicate: Any, *, timeout_s: float, what: str, stack: ChaosStack | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{stack.logs() if stack else ''}")


def shards_started(job_id: str, count: int) -> Callable[[], bool]:
    def started() -> bool:
        job = Job.objects.get(pk=job_id)
        prefixes = [Path(s.prefix_uri.removeprefix("file://")) / "started" for s in job.shards.all()]
        return sum(1 for p in prefixes if p.exists()) >= count

    return started


def last_window_running(job_id: str) -> Callable[[], bool]:
    """The job is planned, none of its shards waits to be sent, and some still run."""

    def running() -> bool:
        job = Job.objects.get(pk=job_id)
        statuses = set(job.shards.values_list("status", flat=True))
        return job.status == "running" and "pending" not in statuses and "dispatched" in statuses

    return running


def commits(job_id: str) -> Callable[[], int]:
    def count() -> int:
        job = Job.objects.get(pk=job_id)
        return sum(1 for s in job.shards.all() if (Path(s.prefix_uri.removeprefix("file://")) / "commit.json").exists())

    return count
