"""The whole stack on one machine, as child processes: what `manage.py up` and `make demo` run.

Where CELERY_BROKER_URL is unset an embedded Redis is started and its URL handed to every child;
where DATABASE_URL is unset the children share the settings' SQLite file.

Each part runs in a session of its own (Ctrl-C in the terminal reaches the stack, which stops the parts
in order) and is tied to the stack's life (`tether`): where the stack dies, even by SIGKILL, each part
gets a signal from the kernel that ends it (`_spawn`'s `orphan_signal`). Stopping is quick (`stop`, a
few seconds): the Celery workers and the slots take Celery's cold shutdown, with no soft shutdown
(BATCHERY_SOFT_SHUTDOWN_S=0 unless set), so a shard or a control task that was running goes back to the
queue unacknowledged (`acks_late`, `reject_on_worker_lost`) and runs again, once, at the next start (the
commit protocol makes the second run safe); the portal takes gunicorn's quick shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from kombu import Connection

from portal.devstack.embedded import EmbeddedRedis, start_embedded_redis
from portal.devstack.tether import dies_with_this_process
from portal.ops.flower import AUTH_VARIABLE, basic_auth_configured, generated_credentials
from tasks.app import app
from tasks.shared.config import celery_settings

logger = logging.getLogger(__name__)

BASE_DIR = Path(settings.BASE_DIR)
STOP_GRACE_S = 10.0
"""How long `Stack.stop` waits for the parts to stop by themselves before it kills what is left."""
COLD_SHUTDOWN = signal.SIGQUIT
"""Celery's cold shutdown: running tasks are cancelled and their unacknowledged messages given back."""
ORPHANED_WORKER = signal.SIGKILL
"""What a Celery worker gets where the stack died: its cold shutdown would wait for ever on an embedded Redis
gone with the stack (its pool's processes die with it; a task it ran comes back after the visibility
timeout, or the sweep's)."""
QUICK_SHUTDOWN = signal.SIGINT
"""gunicorn's quick shutdown (SIGTERM would let each request in flight run up to its graceful timeout)."""


@dataclass
class StackOptions:
    portal: bool = True
    portal_address: str = "127.0.0.1:8000"
    portal_workers: int = 4
    """gunicorn's sync workers, as the deployment files run it: with fewer, under many polling clients
    every request queues behind a slow one (`manage.py bench --api-portal-workers` compares)."""
    flower: bool = True
    flower_port: int = 5555
    cpu_slots: int | None = None
    gpus: str | None = None
    """The launcher's `--gpus` (device indexes such as `0`); None: every GPU NVML finds."""
    metrics_port: int = 9310
    """The launcher's /metrics port, on 127.0.0.1; 0 serves none."""
    loglevel: str = "WARNING"
    logs_to_files: bool = False
    """Send each process's output to var/logs/<name>.log instead of this terminal."""
    workers: bool = True
    """The control worker and beat, the planning, webhooks and validation workers and the slots; off for a
    benchmark of the portal alone."""


def repoint_celery_app() -> None:
    """Point this process's Celery app at the broker the environment names now (`redis_client` follows by itself)."""
    app.conf.update(celery_settings())
    # Celery builds its result backend and its broker connection pools once, from the settings of
    # their first use, and keeps them: dropped (the pools as Celery's own `_after_fork` drops them),
    # they are built again from these. Kept, a process that pointed the app at a Redis of its own and
    # back went on using the first, even once that Redis was gone.
    app._backend_cache = None  # type: ignore[attr-defined]  # not in the type stubs
    app._local.backend = None  # type: ignore[attr-defined]
    app._pool = None  # type: ignore[attr-defined]
    app.amqp._producer_pool = None  # type: ignore[attr-defined]


@dataclass
class Stack:
    options: StackOptions
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    redis: EmbeddedRedis | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    stop_signals: dict[str, signal.Signals] = field(default_factory=dict)
    flower_login: tuple[str, str] | None = None
    """The user and password `start` generated for Flower, for `up` to print once; None when configured."""

    def configure_services(self) -> None:
        """Start an embedded Redis when no broker is configured, and point this process at it."""
        if not self.env.get("CELERY_BROKER_URL"):
            self.redis = start_embedded_redis(Path(settings.VAR_DIR) / "redis", tied=True)
            for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
                self.env[name] = self.redis.url
                os.environ[name] = self.redis.url
            logger.info("embedded Redis on %s", self.redis.url)
            repoint_celery_app()
            self._give_back_unacknowledged()

    def _give_back_unacknowledged(self) -> None:
        """Put the messages that a worker of this stack's last run took and never acknowledged back on their
        queues: killed with the stack, it could not give them back to an embedded Redis gone at the same
        moment. That Redis is this stack's alone, so no live worker holds them, and the broker would hand
        them out again only after its visibility timeout (the shard time limit and ten minutes)."""
        assert self.redis is not None
        options = {**app.conf.broker_transport_options, "visibility_timeout": 0}
        with Connection(self.redis.url, transport_options=options) as connection:
            channel: Any = connection.default_channel
            with channel.conn_or_acquire() as client:
                unacknowledged = int(client.zcard(channel.unacked_index_key))
            if unacknowledged:
                channel.qos.restore_visible(num=unacknowledged)
                logger.warning("%d messages the last run left unacknowledged are back on their queues", unacknowledged)

    def _portal_env(self) -> dict[str, str]:
        """The portal's environment: gunicorn's workers share a fresh metrics directory."""
        directory = Path(settings.VAR_DIR) / "metrics" / "portal"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        return {**self.env, "PROMETHEUS_MULTIPROC_DIR": str(directory)}

    def _spawn(
        self,
        name: str,
        command: list[str],
        env: dict[str, str] | None = None,
        *,
        stop_signal: signal.Signals,
        orphan_signal: signal.Signals | None = None,
    ) -> None:
        """Start a part in a session of its own, sent `stop_signal` by `stop`, and `orphan_signal` (by default
        the same) by the kernel where the stack dies."""
        output = None
        if self.options.logs_to_files:
            log_dir = Path(settings.VAR_DIR) / "logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            output = (log_dir / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            command,
            env=env or self.env,
            cwd=BASE_DIR,
            start_new_session=True,
            preexec_fn=dies_with_this_process(orphan_signal or stop_signal),
            stdout=output,
            stderr=output,
        )
        self.stop_signals[name] = stop_signal
        if output is not None:
            output.close()
        logger.info("%s started (pid %d)", name, self.processes[name].pid)

    def start(self) -> None:
        self.configure_services()
        # Weights load from disk; hub progress bars and look-ups are noise (and impossible offline).
        self.env.setdefault("HF_HUB_OFFLINE", "1")
        self.env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        self.env.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # A stop within seconds: a running shard goes back to the queue at once (Celery's soft shutdown
        # would sleep its whole timeout, the shard time limit by default, before giving it back).
        self.env.setdefault("BATCHERY_SOFT_SHUTDOWN_S", "0")
        python = sys.executable
        options = self.options
        # collectstatic: WhiteNoise serves the portal's and the admin's assets from STATIC_ROOT.
        setup = [
            ["migrate", "--no-input", "-v", "0"],
            ["catalog", "publish"],
            ["collectstatic", "--no-input", "-v", "0"],
        ]
        for command in setup:
            subprocess.run([python, "manage.py", *command], env=self.env, cwd=BASE_DIR, check=True)
        if options.portal:
            self._spawn(
                "portal",
                [
                    python, "-m", "gunicorn", "portal.wsgi", "--bind", options.portal_address,
                    "--workers", str(options.portal_workers),
                    "--config", "python:portal.gunicorn_conf",
                ],
                env=self._portal_env(),
                stop_signal=QUICK_SHUTDOWN,
            )  # fmt: skip
        if options.flower:
            self._spawn_flower()
        if options.workers:
            self._spawn_workers()

    def _spawn_flower(self) -> None:
        """Flower on loopback through the deployments' entry point (portal/ops/flower.py), which refuses to
        run without basic auth: with none configured, a generated password goes into Flower's environment
        only (never its command line, nor the other processes' environment)."""
        env = self.env
        if not basic_auth_configured(env):
            self.flower_login = generated_credentials()
            env = {**env, AUTH_VARIABLE: ":".join(self.flower_login)}
        self._spawn(
            "flower",
            [sys.executable, "-m", "portal.ops.flower", "--address=127.0.0.1", f"--port={self.options.flower_port}"],
            env=env,
            stop_signal=signal.SIGTERM,
        )

    def _spawn_workers(self) -> None:
        python, options = sys.executable, self.options
        self._spawn(
            "control",
            [
                python, "-m", "celery", "--app", "tasks.app", "worker", "--queues", "control",
                "--concurrency", "2", "--hostname", "control@%h", "--loglevel", options.loglevel,
            ],
            stop_signal=COLD_SHUTDOWN,
            orphan_signal=ORPHANED_WORKER,
        )  # fmt: skip
        # Beat schedules the reconciler; one a site. A process of its own, not the control worker's `--beat`,
        # whose child would outlive a control worker killed where the stack died.
        schedule = Path(settings.VAR_DIR) / "celerybeat-schedule"
        self._spawn(
            "beat",
            [
                python, "-m", "celery", "--app", "tasks.app", "beat", "--schedule", str(schedule),
                "--loglevel", options.loglevel,
            ],
            stop_signal=signal.SIGTERM,
        )  # fmt: skip
        # Planning, webhook deliveries and batch validations off the control lane, each on a worker of
        # its own, as the deployments run them: a large input, a slow receiver or a pile of large files
        # never holds the settling of shard endings.
        for queue, concurrency in (("planning", 1), ("webhooks", 4), ("validation", 1)):
            self._spawn(
                queue,
                [
                    python, "-m", "celery", "--app", "tasks.app", "worker", "--queues", queue,
                    "--concurrency", str(concurrency), "--hostname", f"{queue}@%h", "--loglevel", options.loglevel,
                ],
                stop_signal=COLD_SHUTDOWN,
                orphan_signal=ORPHANED_WORKER,
            )  # fmt: skip
        launch = [python, "-m", "gpuworkers", "launch", "--loglevel", options.loglevel]
        launch += ["--metrics-port", str(options.metrics_port), "--metrics-address", "127.0.0.1"]
        if options.cpu_slots:
            launch += ["--cpu-slots", str(options.cpu_slots)]
        if options.gpus:
            launch += ["--gpus", options.gpus]
        # The launcher drains on SIGTERM, orphaned too: each slot gets SIGTERM, which it takes as Celery's cold
        # shutdown (`gpuworkers.launcher.worker_env`), with no soft shutdown here, within the launcher's bound.
        self._spawn("gpuworkers", launch, stop_signal=signal.SIGTERM)

    def wait_for_workers(self, *, queues: set[str], timeout_s: float = 120.0) -> None:
        """Block until a worker consumes each of `queues` (models load lazily; imports take seconds)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            active = app.control.inspect(timeout=1.0).active_queues() or {}
            consumed = {queue["name"] for worker in active.values() for queue in worker}
            if queues <= consumed:
                return
        raise TimeoutError(f"no worker consumed {sorted(queues)} within {timeout_s:.0f}s")

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}")

    def stop(self, *, grace_s: float = STOP_GRACE_S) -> None:
        """Send each part its stop signal, give them `grace_s` together, then kill each part's session
        (what it left behind too); the embedded Redis last, so that the workers give their messages back."""
        for name, process in self.processes.items():
            if process.poll() is None:
                process.send_signal(self.stop_signals.get(name, signal.SIGTERM))
        deadline = time.monotonic() + grace_s
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s: killed", name, grace_s)
            # A part's own children (pool processes, gunicorn's workers) go with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self.redis is not None:
            self.redis.stop()
