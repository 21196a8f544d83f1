"""One simulated run: the control plane's processes, the virtual fleet, the workload, the figures.

The control plane is the product's: `--control-workers` Celery workers of the `control` queue (the first
one runs beat, which schedules the reconciler), PostgreSQL, Redis and the store configured for this
process (an embedded Redis where none is). The fleet is `fleet_processes` processes of virtual slots
(`bench.simulate.fleet`), hosts of eight slots, the classes in equal parts. The run submits the workload
for `minutes`, then cancels what still runs, waits for every job to end and checks each.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from django.conf import settings
from django.db import connection
from django.db.models import Count

from bench.py_spy import cpu_seconds_of
from bench.simulate import report
from bench.simulate.cpu import MACHINE, cpu_spent, machine_busy, tree_cpu
from bench.simulate.gpu_model import GPU_CLASSES
from bench.simulate.workload import (
    TENANT_PREFIX,
    PlannedJob,
    Submitted,
    WorkloadOptions,
    catalog_setup,
    submit,
    tenants_setup,
    workload_plan,
)
from portal.jobs.models import FINAL_STATUSES, Job, Shard, ShardStatus
from portal.jobs.services.pause import job_pause, job_resume
from portal.jobs.services.stop import CannotStop, job_cancel
from portal.ops.selectors import fleet_slots
from tasks.shared.config import gpu_queue
from tasks.shared.redis_client import redis_client

SLOTS_PER_HOST = 8


@dataclass
class SimulationOptions:
    slots: int = 1000
    tenants: int = 200
    shard_seconds: int = 20
    minutes: float = 10.0
    control_workers: int = 1
    control_concurrency: int = 4
    planning_concurrency: int = 2
    first_shard_seconds: float | None = None
    """The slow start of a job's shards (`BATCHERY_FIRST_SHARD_SECONDS`); None: this site's setting."""
    fleet_processes: int = 4
    spread: float = 0.1
    faults: bool = True
    small_jobs_per_s: float | None = None
    largest_job: int = 1_000_000
    warmup_s: float | None = None
    sample_jobs: int = 20
    seed: int = 7

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.minutes * 60 * 0.15)


@dataclass
class Processes:
    """The processes the run started, by name."""

    started: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, name: str, command: list[str], env: dict[str, str], log_dir: Path) -> None:
        # Each run's log anew: the scheduler's tick times are read from the control side's logs.
        with (log_dir / f"{name}.log").open("wb") as log:
            self.started[name] = subprocess.Popen(
                command, env=env, cwd=settings.BASE_DIR, start_new_session=True, stdout=log, stderr=log
            )

    def check_alive(self) -> None:
        for name, process in self.started.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see its log")

    def cpu_seconds(self) -> dict[str, dict[int, float]]:
        """CPU seconds by process id: each started process's tree (a worker's pool), PostgreSQL's and Redis's,
        this process's (the workload's driver), and the whole machine's (`MACHINE`, under pid 0)."""
        figures: dict[str, dict[int, float]] = {}
        for name, process in self.started.items():
            figures[name] = tree_cpu(process.pid)
        for label, names in (("postgres", {"postgres"}), ("redis", {"redis-server"})):
            listed = psutil.process_iter(["name"])
            figures[label] = {p.pid: cpu_seconds_of(p) for p in listed if p.info["name"] in names}
        figures["driver"] = {os.getpid(): cpu_seconds_of(psutil.Process())}
        figures[MACHINE] = {0: machine_busy()}
        return figures

    def stop(self, names: list[str] | None = None) -> None:
        chosen = [self.started[n] for n in (names or list(self.started))]
        for process in chosen:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 40
        for process in chosen:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def fleet_layout(options: SimulationOptions) -> list[list[dict[str, str]]]:
    """The virtual slots of each fleet process: hosts of eight slots of one class, dealt out in turn."""
    classes = list(GPU_CLASSES)
    hosts: dict[str, list[dict[str, str]]] = {}
    for n in range(options.slots):
        gpu_class = classes[n % len(classes)]
        index = n // len(classes)
        name = f"sim-{gpu_class.removeprefix('sim-')}-{index // SLOTS_PER_HOST:03d}"
        slot = {
            "host": name,
            "slot": str(index % SLOTS_PER_HOST),
            "gpu_class": gpu_class,
            "queue": gpu_queue(gpu_class),
        }
        hosts.setdefault(name, []).append(slot)
    processes: list[list[dict[str, str]]] = [[] for _ in range(max(1, options.fleet_processes))]
    for n, host_slots in enumerate(hosts.values()):
        processes[n % len(processes)] += host_slots
    return processes


def _key(slot: dict[str, str]) -> str:
    from bench.simulate.fleet import VirtualSlot

    return VirtualSlot(host=slot["host"], slot=slot["slot"], gpu_class=slot["gpu_class"], queue=slot["queue"]).key


def fault_plan(options: SimulationOptions, slots: list[dict[str, str]], rng: random.Random) -> list[dict[str, Any]]:
    """The faults of one fleet process, at fixed fractions of the run: 1 % of its slots vanish mid-shard
    (back after a minute), 1 % turn three times slower, one class drains for a tenth of the run, one host
    loses its broker for a minute."""
    if not options.faults or not slots:
        return []
    run_s = options.minutes * 60
    count = max(1, len(slots) // 100)
    keys = [_key(slot) for slot in slots]
    drained_class = list(GPU_CLASSES)[-1]
    host = rng.choice(sorted({slot["host"] for slot in slots}))
    return [
        {"kind": "vanish", "at_s": run_s * 0.2, "slots": rng.sample(keys, count), "duration_s": 60},
        {"kind": "slow", "at_s": run_s * 0.3, "slots": rng.sample(keys, count), "slowness": 3.0},
        {
            "kind": "drain",
            "at_s": run_s * 0.4,
            "slots": [_key(s) for s in slots if s["gpu_class"] == drained_class],
            "duration_s": run_s * 0.1,
        },
        {
            "kind": "broker_loss",
            "at_s": run_s * 0.6,
            "slots": [_key(s) for s in slots if s["host"] == host],
            "duration_s": 60,
        },
    ]


def control_environment(options: SimulationOptions) -> dict[str, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        "BATCHERY_TARGET_SHARD_SECONDS": str(options.shard_seconds),
        "PYTHONPATH": str(settings.BASE_DIR),
    }
    if options.first_shard_seconds is not None:
        env["BATCHERY_FIRST_SHARD_SECONDS"] = str(options.first_shard_seconds)
    return env


def start_control(options: SimulationOptions, processes: Processes, env: dict[str, str], run_dir: Path) -> None:
    for n in range(options.control_workers):
        command = [
            sys.executable, "-m", "celery", "--app", "tasks.app", "worker", "--queues", "control",
            "--concurrency", str(options.control_concurrency), "--hostname", f"control{n}@%h", "--loglevel", "INFO",
        ]  # fmt: skip
        if n == 0:
            command += ["--beat", "--schedule", str(run_dir / "beat-schedule")]
        processes.spawn(f"control{n}", command, env, run_dir)
    planning = [
        sys.executable, "-m", "celery", "--app", "tasks.app", "worker", "--queues", "planning",
        "--concurrency", str(options.planning_concurrency), "--hostname", "planning@%h", "--loglevel", "INFO",
    ]  # fmt: skip
    processes.spawn("planning", planning, env, run_dir)


def start_fleet(
    options: SimulationOptions, processes: Processes, env: dict[str, str], run_dir: Path, start: float
) -> list[Path]:
    rng = random.Random(options.seed)
    events = []
    for n, slots in enumerate(fleet_layout(options)):
        config = run_dir / f"fleet{n}.json"
        path = run_dir / f"fleet{n}.events.jsonl"
        path.unlink(missing_ok=True)
        config.write_text(
            json.dumps(
                {"slots": slots, "events_path": str(path), "faults": fault_plan(options, slots, rng), "start": start}
            )
        )
        fleet_env = {key: value for key, value in env.items() if key != "DJANGO_SETTINGS_MODULE"}
        processes.spawn(f"fleet{n}", [sys.executable, "-m", "bench.simulate.fleet", str(config)], fleet_env, run_dir)
        events.append(path)
    return events


def sample(timeline: report.Timeline, redis_peak: Counter[str]) -> None:
    rows = (
        Shard.objects.filter(status=ShardStatus.PENDING, job__status__in=("planning", "running"))
        .values("job__tenant_id", "job__model__gpu_class__name")
        .annotate(n=Count("id"))
    )
    by_class: Counter[str] = Counter()
    by_tenant: dict[tuple[int, str], int] = {}
    for row in rows:
        by_class[row["job__model__gpu_class__name"]] += row["n"]
        by_tenant[(row["job__tenant_id"], row["job__model__gpu_class__name"])] = row["n"]
    timeline.times.append(time.time())
    timeline.pending_by_class.append(dict(by_class))
    timeline.pending_by_tenant.append(by_tenant)
    info = redis_client().info()
    redis_peak["used_memory"] = max(redis_peak["used_memory"], int(info["used_memory"]))
    redis_peak["connected_clients"] = max(redis_peak["connected_clients"], int(info["connected_clients"]))


@dataclass
class Action:
    at: float
    run: Callable[[], None]


@contextmanager
def running(processes: Processes) -> Iterator[None]:
    try:
        yield
    finally:
        processes.stop()


def wait_fleet(slots: int, processes: Processes, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        processes.check_alive()
        if len(fleet_slots()) >= slots:
            return
        time.sleep(1)
    raise TimeoutError(f"only {len(fleet_slots())} of {slots} virtual slots sent a heartbeat in {timeout_s:.0f} s")


def simulate(options: SimulationOptions, say: Callable[[str], None]) -> dict[str, Any]:
    run_dir = Path(settings.VAR_DIR) / "simulate"
    data_dir = run_dir / "inputs"
    data_dir.mkdir(parents=True, exist_ok=True)
    catalog_setup(spread=options.spread)
    tenants = tenants_setup(options.tenants, run=time.strftime("%m%d%H%M%S"))
    small_rate = options.small_jobs_per_s if options.small_jobs_per_s is not None else options.slots / 200
    plan = workload_plan(
        WorkloadOptions(
            slots=options.slots,
            minutes=options.minutes,
            tenants=options.tenants,
            small_jobs_per_s=small_rate,
            largest_job=options.largest_job,
            seed=options.seed,
        ),
        tenants,
    )
    say(f"{len(plan)} jobs planned, {sum(job.records for job in plan):,} records")
    env = control_environment(options)
    processes = Processes()
    with running(processes):
        start_control(options, processes, env, run_dir)
        _end_earlier_runs(processes, say)
        start = time.time() + 30
        events_paths = start_fleet(options, processes, env, run_dir, start)
        wait_fleet(options.slots, processes)
        say(f"{options.slots} virtual slots beating; {options.control_workers} control process(es)")
        time.sleep(max(0.0, start - time.time()))
        submitted, timeline, redis_peak, window, cpu = _drive(options, plan, data_dir, processes, say)
        say("run over: cancelling what still runs and waiting for every job to end")
        for job in Job.objects.exclude(status__in=FINAL_STATUSES).filter(
            pk__in=[s.job_id for s in submitted if s.job_id]
        ):
            _cancel(job)
        _wait_ended(lambda: _submitted_ids(submitted), processes)
        _link_batches(submitted)
        exact = report.check_exactly_once(submitted, sample=options.sample_jobs)
    (run_dir / "timeline.json").write_bytes(timeline.to_json())
    events = report.read_events(events_paths)
    begin, measure_start, measure_end = window
    by_id = {s.job_id: s for s in submitted if s.job_id}
    gaps = report.idle_gaps(events, timeline, measure_start, measure_end)
    # Over the whole run: a tenant served first while the fleet was empty waits its turn afterwards.
    deviation, fair_tenants = report.fair_share_deviation(
        events, timeline, by_id, begin, measure_end, waiting_from=measure_start
    )
    ticks = report.scheduler_ticks([*run_dir.glob("control*.log"), run_dir / "planning.log"])
    endings = report.endings_per_s(events, measure_start, measure_end)
    shard_endings = endings * (measure_end - measure_start)
    return {
        "options": options,
        "jobs": len(submitted),
        "endings_per_s": endings,
        "gaps": gaps,
        "shard_lengths": report.shard_lengths(events, measure_start, measure_end),
        "fair_share_max_deviation": deviation,
        "fair_tenants": fair_tenants,
        "ticks": ticks,
        "exact": exact,
        "cpu": cpu,
        "cores": psutil.cpu_count(),
        "shard_endings": shard_endings,
        "redis": dict(redis_peak),
        "tables": _table_sizes(),
        "faults": [e for e in events if "fault" in e],
    }


def _drive(
    options: SimulationOptions, plan: list[PlannedJob], data_dir: Path, processes: Processes, say: Callable[[str], None]
) -> tuple[list[Submitted], report.Timeline, Counter[str], tuple[float, float, float], dict[str, float]]:
    rng = random.Random(options.seed + 1)
    begin = time.time()
    end = begin + options.minutes * 60
    timeline = report.Timeline()
    redis_peak: Counter[str] = Counter()
    actions: list[Action] = []
    submitted: list[Submitted] = []
    pending = list(plan)
    next_sample = begin
    next_say = begin + 30
    cpu_start: dict[str, dict[int, float]] | None = None
    measure_start = begin + options.warmup
    # The window every figure is measured over starts when the CPU is first read, which a burst of
    # submissions (the backlogs, at the start) may delay past the warm-up.
    measured_from = measure_start
    while time.time() < end:
        now = time.time()
        while pending and begin + pending[0].at_s <= now:
            planned = pending.pop(0)
            job = submit(planned, data_dir=data_dir, number=len(submitted), rng=rng)
            submitted.append(job)
            actions += _stops(planned, job, now)
        for action in [a for a in actions if a.at <= now]:
            actions.remove(action)
            action.run()
        if now >= next_sample:
            sample(timeline, redis_peak)
            next_sample = now + 2.0
        if cpu_start is None and now >= measure_start:
            cpu_start = processes.cpu_seconds()
            measured_from = time.time()
        if now >= next_say:
            processes.check_alive()
            say(f"{now - begin:.0f} s: {len(submitted)} jobs submitted, {len(fleet_slots())} slots beating")
            next_say = now + 30
        time.sleep(0.05)
    cpu_end = processes.cpu_seconds()
    measured_to = time.time()
    cpu = cpu_spent(cpu_start or {}, cpu_end)
    return submitted, timeline, redis_peak, (begin, measured_from, measured_to), cpu


def _stops(planned: PlannedJob, job: Submitted, now: float) -> list[Action]:
    if not job.job_id:
        return []

    def cancel() -> None:
        if _cancel(Job.objects.get(pk=job.job_id)):
            job.actions.append("cancelled")

    def pause() -> None:
        found = Job.objects.get(pk=job.job_id)
        if found.status == "running":
            job_pause(job=found)
            job.actions.append("paused")

    def resume() -> None:
        found = Job.objects.get(pk=job.job_id)
        if found.status == "paused":
            job_resume(job=found)
            job.actions.append("resumed")

    if planned.cancel_after_s is not None:
        return [Action(now + planned.cancel_after_s, cancel)]
    if planned.pause_for_s is not None:
        return [Action(now + 20, pause), Action(now + 20 + planned.pause_for_s, resume)]
    return []


def _end_earlier_runs(processes: Processes, say: Callable[[str], None]) -> None:
    """Cancel what an earlier run left unfinished (one stopped midway), so that this run's slots and
    figures are this run's own."""
    left = list(Job.objects.filter(tenant__name__startswith=TENANT_PREFIX).exclude(status__in=FINAL_STATUSES))
    if not left:
        return
    say(f"cancelling {len(left)} jobs an earlier run left unfinished")
    for job in left:
        _cancel(job)
    ids = [str(job.pk) for job in left]
    _wait_ended(lambda: ids, processes)


def _cancel(job: Job) -> bool:
    """Cancel the job unless it ended meanwhile."""
    try:
        job_cancel(job=job)
    except CannotStop:
        return False
    return True


def _link_batches(submitted: list[Submitted]) -> None:
    """A batch validated on its queue gets its job later: read it now."""
    from portal.openai_api.models import Batch

    for job in submitted:
        if job.batch_id and not job.job_id:
            found = Batch.objects.get(pk=job.batch_id)
            job.job_id = str(found.job_id or "")


def _wait_ended(job_ids: Callable[[], list[str]], processes: Processes, *, stall_s: float = 180.0) -> None:
    """Wait for the jobs `job_ids()` names to end, for as long as one of them ends every `stall_s`
    seconds: cancelling thousands of jobs at the end of a large run takes the control plane minutes."""
    deadline = time.monotonic() + stall_s
    left = None
    while time.monotonic() < deadline:
        processes.check_alive()
        now_left = Job.objects.filter(pk__in=job_ids()).exclude(status__in=FINAL_STATUSES).count()
        if not now_left:
            return
        if now_left != left:
            left, deadline = now_left, time.monotonic() + stall_s
        time.sleep(2)


def _submitted_ids(submitted: list[Submitted]) -> list[str]:
    """The jobs of the run, a batch's once its validation made it (`_link_batches`)."""
    _link_batches(submitted)
    return [s.job_id for s in submitted if s.job_id]


def _table_sizes() -> dict[str, dict[str, int]]:
    sizes = {}
    if connection.vendor != "postgresql":
        return {}
    with connection.cursor() as cursor:
        for table in ("jobs_shard", "jobs_jobevent", "jobs_job"):
            cursor.execute(
                "SELECT count(*), pg_relation_size(%s), pg_indexes_size(%s), pg_total_relation_size(%s) FROM " + table,
                [table, table, table],
            )
            rows, heap, indexes, total = cursor.fetchone()
            sizes[table] = {"rows": rows, "heap": heap, "indexes": indexes, "total": total}
    return sizes
