"""Real Celery worker processes for pipeline tests: started, awaited, and always stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]


@dataclass
class WorkerProcess:
    name: str
    queue: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes] = field(repr=False)

    @property
    def hostname(self) -> str:
        return f"{self.name}@test"

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_workers([self], timeout_s=timeout_s)


def stop_workers(workers: Iterable[WorkerProcess], *, timeout_s: float = 20.0) -> None:
    """Stop the workers together: each is told first, then each is waited for (a Celery worker's warm shutdown takes
    seconds even idle, so a stack's workers stopped one after the other took a test's teardown ten seconds or more);
    one still running after `timeout_s` is killed with its pool."""
    workers = list(workers)
    for worker in workers:
        if worker.process.poll() is None:
            # SIGTERM to the main process only is Celery's warm shutdown; sent to the whole group it
            # would also kill the pool child in the middle of its task.
            worker.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.wait()
        worker.log.close()


CONFIGURED_SERVICES = {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "DATABASE_URL", "BATCHERY_STORAGE_URL"}


def newcomer_env(var_dir: Path) -> dict[str, str]:
    """This environment as a newcomer's machine has it: no broker, database or storage configured (the
    project starts embedded Redis and uses SQLite), its files under `var_dir`."""
    env = {name: value for name, value in os.environ.items() if name not in CONFIGURED_SERVICES}
    env["BATCHERY_VAR_DIR"] = str(var_dir)
    return env


def manage_as_newcomer(*args: str, var_dir: Path, timeout_s: float = 300) -> str:
    """`python manage.py *args` in a newcomer's environment (`newcomer_env`); its output, once it succeeded."""
    finished = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=newcomer_env(var_dir),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return finished.stdout


def database_url(settings_dict: dict[str, object]) -> str:
    """The URL of the database Django is using now (the test database, once it exists)."""
    engine = str(settings_dict["ENGINE"])
    name = settings_dict["NAME"]
    if "sqlite" in engine:
        return f"sqlite:///{name}"
    user = settings_dict.get("USER") or "postgres"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{name}"


def start_worker(
    name: str,
    queue: str,
    *,
    env: dict[str, str],
    log_dir: Path,
    concurrency: int = 1,
    extra_args: list[str] | None = None,
    heartbeat: bool = False,
) -> WorkerProcess:
    """A worker consuming `queue`; with `heartbeat`, sending worker heartbeats as the launcher's slots and the
    control worker do (their event dispatcher then runs, and a monitor can turn task events on)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = log_path.open("ab")
    command = [
        sys.executable, "-m", "celery", "--app", "tasks.app", "worker",
        "--queues", queue, "--concurrency", str(concurrency), "--prefetch-multiplier", "1",
        "--pool", "prefork", "--hostname", f"{name}@test", "--loglevel", "INFO",
        "--without-gossip", "--without-mingle", *([] if heartbeat else ["--without-heartbeat"]), *(extra_args or []),
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return WorkerProcess(name=name, queue=queue, process=process, log_path=log_path, log=log)


def wait_until_consuming(workers: list[WorkerProcess], *, timeout_s: float = 120.0) -> None:
    """Block until every worker answers a ping, or fail with its log."""
    from tasks.app import app

    expected = {worker.hostname for worker in workers}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker {worker.name} exited early:\n{worker.log_tail()}")
        replies = app.control.ping(timeout=1.0) or []
        answered = {name for reply in replies for name in reply}
        if expected <= answered:
            return
    logs = "\n".join(f"--- {w.name}\n{w.log_tail()}" for w in workers)
    raise TimeoutError(f"workers did not answer within {timeout_s}s:\n{logs}")


def wait_until_idle(workers: list[WorkerProcess], *, timeout_s: float = 60.0) -> None:
    """Block until no worker runs or holds a task, twice in a row half a second apart: a test that leaves
    work behind (a cancelled job's callbacks, its cancellation) would otherwise have the session's workers
    write to the database while the next teardown truncates it (a deadlock)."""
    from tasks.app import app

    inspect = app.control.inspect(destination=[worker.hostname for worker in workers], timeout=1.0)
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while time.monotonic() < deadline and quiet < 2:
        busy = [inspect.active() or {}, inspect.reserved() or {}]
        answered = all(len(replies) == len(workers) for replies in busy)
        quiet = quiet + 1 if answered and not any(tasks for replies in busy for tasks in replies.values()) else 0
        time.sleep(0.5)
    if quiet < 2:
        logs = "\n".join(f"--- {w.name}\n{w.log_tail()}" for w in workers)
        raise TimeoutError(f"workers still busy after {timeout_s}s:\n{logs}")
