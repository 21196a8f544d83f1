"""The I/O half of `manage.py bench`: planning and merging of large JSONL inputs, and their memory.

For each input size the benchmark writes (or reuses) an input under `VAR_DIR/bench`, creates a queued
job for it, plans it with `job_plan` in a child process, gives every shard a committed attempt (output
lines a worker could have written, committed where `run_shard` commits them, and settled as each
shard's callback settles it), and merges with
`job_merge` in another child process. Each child times its step and reports its own peak RSS, so a
planner or merger whose memory grows with the input shows up as a ratio above 1 between sizes.

Choices, and why:

- The job is created with the ORM as `job_submit` creates it (row and `queued` event), without
  `job_submit` itself: that would enqueue `plan_job` on the broker, and a worker could plan the job
  under the benchmark's feet. Both sizes are therefore checked line by line by the planner, as any
  input over `BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES` is; quota reservation is skipped.
- Planning ends, as in production, by scheduling the job's first shards on commit. The planner child
  sends them to an in-memory broker so no worker runs them; scheduling stays inside the measured time.
- The merger child has an in-memory broker whose publications are counted and Celery's result backend
  disabled: a merge of committed shards must do neither, and the benchmark fails if it tries.
- Fabricating shard outputs is not measured; it reuses the real spec, attempt marker and manifest.
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import os
import random
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from celery.signals import before_task_publish
from django.conf import settings
from django.db import transaction
from rich.console import Console
from rich.table import Table

from portal.catalog.models import Model
from portal.devstack.demo import ENDINGS, OBJECTS, SUBJECTS, VERBS
from portal.execution.dispatch import shard_spec
from portal.execution.merge import job_merge
from portal.execution.plan import job_plan
from portal.execution.settle import shard_record_success
from portal.jobs.models import Job, JobEvent, JobStatus, Shard
from portal.jobs.services.request_checks import normalize_input_uri
from portal.jobs.storage_layout import errors_uri, job_prefix, output_uri
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.config import REPO_DIR, progress_redis_url
from tasks.shared.specs import ShardManifest
from tasks.shared.storage import join_uri, store_for
from tasks.slot.shard_execution import start_attempt

MB = 1_000_000
DEFAULT_SIZES_MB = (200, 2000)
SHARD_SIZE = 10_000
BENCH_MODEL = "all-MiniLM-L6-v2"
BENCH_TENANT = "bench"
FABRICATED_WORKER = "bench-fabricated@io"
# Inputs are built from this many distinct texts of one to six sentences each.
TEXT_POOL = 4096
GENERATE_BATCH = 100_000
# A reused input may exceed its nominal size by less than one line.
SIZE_SLACK_BYTES = 4096
READ_CHUNK_BYTES = 1024 * 1024
IN_MEMORY_BROKER = "memory://localhost/"
# The child starts the way a control worker does: Django set up, then the service is called.
CHILD_BOOT = (
    "import sys; from tasks.control.base import ensure_django; ensure_django(); "
    "from bench.plan_merge import child_main; child_main(sys.argv[1:])"
)


class IoBenchError(Exception):
    """A step failed, or its result is not what a correct plan and merge produce."""


@dataclass(frozen=True)
class StepRun:
    """One measured step, as its child process reported it."""

    seconds: float
    start_rss_bytes: int
    """Peak RSS when the step began: the interpreter, Django, the imports."""
    peak_rss_bytes: int
    published: int
    """Celery messages the step sent."""

    @property
    def peak_rss_mb(self) -> float:
        return self.peak_rss_bytes / MB

    @property
    def step_rss_bytes(self) -> int:
        """What the step itself added to the peak."""
        return self.peak_rss_bytes - self.start_rss_bytes


@dataclass(frozen=True)
class IoBenchResult:
    size_mb: int
    job_id: str
    status: str
    input_bytes: int
    records: int
    shards: int
    output_bytes: int
    output_lines: int
    plan: StepRun
    merge: StepRun

    @property
    def plan_mb_s(self) -> float:
        return self.input_bytes / MB / self.plan.seconds

    @property
    def merge_mb_s(self) -> float:
        return self.output_bytes / MB / self.merge.seconds


def _texts(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    combos = list(itertools.product(SUBJECTS, VERBS, OBJECTS, ENDINGS))
    # Letters, spaces and full stops only: safe inside a JSON string without escaping.
    return [" ".join(" ".join(rng.choice(combos)) for _ in range(rng.randint(1, 6))).encode() for _ in range(TEXT_POOL)]


def bench_input(size_mb: int, directory: Path, *, seed: int = 11) -> Path:
    """An input of about `size_mb` MB of {"custom_id", "input"} records, reused if already written."""
    path = directory / f"io-{size_mb}MB.jsonl"
    target = size_mb * MB
    if path.exists() and target <= path.stat().st_size < target + SIZE_SLACK_BYTES:
        return path
    directory.mkdir(parents=True, exist_ok=True)
    texts = _texts(seed)
    rng = random.Random(seed)
    partial = path.with_suffix(".partial")
    written = first = 0
    # Whole batches of lines formatted at once: one json.dumps a line would take minutes for 2 GB.
    with partial.open("wb") as out:
        while written < target:
            picks = rng.choices(texts, k=GENERATE_BATCH)
            lines = [b'{"custom_id":"rec-%010d","input":"%b"}\n' % (first + n, text) for n, text in enumerate(picks)]
            ends = list(itertools.accumulate(map(len, lines)))
            if written + ends[-1] >= target:
                lines = lines[: bisect.bisect_left(ends, target - written) + 1]
            chunk = b"".join(lines)
            out.write(chunk)
            written += len(chunk)
            first += len(lines)
    # Renamed only when complete, so an interrupted run is never mistaken for a finished input.
    partial.replace(path)
    return path


def create_queued_job(*, path: Path, shard_size: int) -> Job:
    """A queued job for `path`, created as `job_submit` creates it but with no `plan_job` message."""
    model = Model.objects.filter(name=BENCH_MODEL, enabled=True).order_by("-created_at").first()
    if model is None:
        raise IoBenchError(f"no enabled model named {BENCH_MODEL!r}; run migrate")
    tenant = tenant_get_or_create(name=BENCH_TENANT)
    uri = normalize_input_uri(str(path))
    job_id = str(uuid.uuid4())
    with transaction.atomic():
        job = Job.objects.create(
            id=job_id,
            tenant=tenant,
            model=model,
            input_uri=uri,
            input_bytes=path.stat().st_size,
            params={},
            shard_size=shard_size,
            output_uri=output_uri(job_id),
            errors_uri=errors_uri(job_id),
        )
        JobEvent.objects.create(job=job, status=JobStatus.QUEUED)
    return job


def _embeddings(seed: int) -> list[bytes]:
    vectors = np.random.default_rng(seed).standard_normal((64, 8)).astype(np.float32)
    return [orjson.dumps(vector, option=orjson.OPT_SERIALIZE_NUMPY) for vector in vectors]


def _output_lines(source: Iterable[bytes], input_field: str, embeddings: list[bytes]) -> tuple[list[bytes], int]:
    """A response line a record, as an embedding worker writes it, and the prompt tokens of them all."""
    lines, tokens = [], 0
    for n, raw in enumerate(source):
        record = orjson.loads(raw)
        count = len(record[input_field].split())
        tokens += count
        lines.append(
            b'{"custom_id":%b,"response":{"embedding":%b,"usage":{"prompt_tokens":%d}}}\n'
            % (orjson.dumps(record["custom_id"]), embeddings[n % len(embeddings)], count)
        )
    return lines, tokens


def commit_shard(job: Job, shard: Shard, embeddings: list[bytes]) -> ShardManifest:
    """Write and commit one shard attempt where `run_shard` does, its output built from its input."""
    spec = shard_spec(job, shard)
    store = store_for(spec.shard_prefix)
    attempt_id = uuid.uuid4().hex
    started_at = time.time()
    start_attempt(store, spec, attempt_id, FABRICATED_WORKER)
    with store_for(spec.input_uri).open_read(spec.input_uri) as source:
        lines, tokens = _output_lines(source, spec.input_field, embeddings)
    # The attempt's objects are named as `tasks.slot.shard_execution._run_attempt` names them.
    attempt_prefix = join_uri(spec.shard_prefix, "attempts", attempt_id)
    manifest = ShardManifest(
        job_id=spec.job_id,
        shard_index=spec.shard_index,
        attempt_id=attempt_id,
        worker=FABRICATED_WORKER,
        pid=os.getpid(),
        output_uri=f"{attempt_prefix}.output.jsonl",
        errors_uri=f"{attempt_prefix}.errors.jsonl",
        records=len(lines),
        succeeded=len(lines),
        failed=0,
        started_at=started_at,
        finished_at=time.time(),
        compute_seconds=0.0,
        load_seconds=0.0,
        cache_hit=True,
        model_loads=1,
        prompt_tokens=tokens,
    )
    with store.open_write(manifest.output_uri) as output, store.open_write(manifest.errors_uri):
        output.write(b"".join(lines))
    if not store.put_if_absent(spec.commit_uri, orjson.dumps(manifest.to_dict())):
        raise IoBenchError(f"shard {shard.index} of job {job.id} was already committed")
    return manifest


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    Linux's VmHWM belongs to the process's own address space; ru_maxrss would also count the parent's
    resident memory at fork, which Linux carries across exec into the child.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


STEPS: dict[str, Callable[..., None]] = {"plan": job_plan, "merge": job_merge}


def _celery_in_memory(step: str) -> None:
    """Point this child's Celery at an in-memory broker: the chords planning sends are counted, never
    queued for a fleet that is not there, and the child works whatever broker the environment names,
    a stopped one included. Celery reads CELERY_BROKER_URL and CELERY_RESULT_BACKEND from the
    environment before its own settings, so they are set there; leases and progress stay on the Redis
    they would have used."""
    os.environ["BATCHERY_PROGRESS_REDIS_URL"] = progress_redis_url()
    os.environ["CELERY_BROKER_URL"] = IN_MEMORY_BROKER
    # The planner's chord needs a result backend to join on; a merge of committed shards needs none.
    os.environ["CELERY_RESULT_BACKEND"] = "cache+memory://" if step == "plan" else "disabled"


def child_main(argv: Sequence[str]) -> None:
    """Inside the child: run one step on one job and print its figures as one JSON line."""
    step, job_id = argv
    published = 0

    def count(**_: Any) -> None:
        nonlocal published
        published += 1

    before_task_publish.connect(count, weak=False)
    _celery_in_memory(step)
    start_rss = peak_rss_bytes()
    started = time.perf_counter()
    STEPS[step](job_id=job_id)
    seconds = time.perf_counter() - started
    figures = {"seconds": seconds, "start_rss_bytes": start_rss, "peak_rss_bytes": peak_rss_bytes()}
    print(json.dumps({**figures, "published": published}))


def run_step(step: str, job_id: str, *, child_env: dict[str, str]) -> StepRun:
    """Run `step` in a fresh process, so that its peak RSS is its own."""
    finished = subprocess.run(
        [sys.executable, "-c", CHILD_BOOT, step, job_id],
        cwd=REPO_DIR,
        env={**os.environ, **child_env},
        capture_output=True,
        text=True,
        check=False,
    )
    if finished.returncode != 0:
        raise IoBenchError(f"the {step} process failed ({finished.returncode}):\n{finished.stderr[-4000:]}")
    return StepRun(**json.loads(finished.stdout.strip().splitlines()[-1]))


def _count_lines(uri: str) -> tuple[int, int]:
    """(bytes, lines) of a stored object, read in chunks."""
    size = lines = 0
    with store_for(uri).open_read(uri) as stream:
        while chunk := stream.read(READ_CHUNK_BYTES):
            size += len(chunk)
            lines += chunk.count(b"\n")
    return size, lines


def bench_one(size_mb: int, *, shard_size: int, child_env: dict[str, str], say: Callable[[str], None]) -> IoBenchResult:
    say(f"{size_mb} MB: writing or reusing the input ...")
    path = bench_input(size_mb, Path(settings.VAR_DIR) / "bench")
    job = create_queued_job(path=path, shard_size=shard_size)
    job_id = str(job.id)
    try:
        say(f"{size_mb} MB: planning job {job_id} ...")
        plan = run_step("plan", job_id, child_env=child_env)
        job.refresh_from_db()
        if job.status != JobStatus.RUNNING:
            raise IoBenchError(f"planning left job {job_id} {job.status}: {job.error}")
        say(f"{size_mb} MB: committing {job.shard_count} shard outputs (not measured) ...")
        embeddings = _embeddings(seed=size_mb)
        for shard in job.shards.order_by("index").iterator():
            shard_record_success(shard, commit_shard(job, shard, embeddings))
        say(f"{size_mb} MB: merging ...")
        merge = run_step("merge", job_id, child_env=child_env)
        job.refresh_from_db()
        if merge.published:
            raise IoBenchError(f"the merge of committed shards sent {merge.published} Celery messages")
        output_bytes, output_lines = _count_lines(job.output_uri)
        if job.status != JobStatus.SUCCEEDED or output_lines != job.total_records:
            raise IoBenchError(
                f"job {job_id} ended {job.status} with {output_lines} output lines for {job.total_records} records"
            )
        return IoBenchResult(
            size_mb=size_mb,
            job_id=job_id,
            status=job.status,
            input_bytes=job.input_bytes,
            records=job.total_records,
            shards=job.shard_count,
            output_bytes=output_bytes,
            output_lines=output_lines,
            plan=plan,
            merge=merge,
        )
    except BaseException:
        # A job left queued or running would be planned and run by the next stack's reconciler on this
        # database, in the middle of another benchmark.
        Job.objects.filter(pk=job_id).delete()
        raise
    finally:
        # Shard inputs, attempts and outputs are several times the input; the input is kept for reuse.
        root = job_prefix(job_id)
        store_for(root).delete_prefix(root)


def run_io_bench(
    sizes_mb: Sequence[int],
    *,
    shard_size: int = SHARD_SIZE,
    child_env: dict[str, str] | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> list[IoBenchResult]:
    """Plan and merge a job of each input size; `child_env` is added to the children's environment
    (tests name their own database there)."""
    return [bench_one(size, shard_size=shard_size, child_env=child_env or {}, say=say) for size in sizes_mb]


def render_io_results(results: Sequence[IoBenchResult]) -> str:
    """The table of figures, and how peak RSS changed from the smallest input to the largest."""
    table = Table(title="Planning and merging large JSONL inputs (each step in its own process)")
    for header in (
        "input MB",
        "records",
        "shards",
        "plan s",
        "plan MB/s",
        "plan peak RSS MB",
        "output MB",
        "merge s",
        "merge MB/s",
        "merge peak RSS MB",
    ):
        table.add_column(header, justify="right")
    for r in results:
        table.add_row(
            f"{r.input_bytes / MB:,.0f}",
            f"{r.records:,}",
            f"{r.shards:,}",
            f"{r.plan.seconds:.1f}",
            f"{r.plan_mb_s:.1f}",
            f"{r.plan.peak_rss_mb:.0f} (+{r.plan.step_rss_bytes / MB:.0f})",
            f"{r.output_bytes / MB:,.0f}",
            f"{r.merge.seconds:.1f}",
            f"{r.merge_mb_s:.1f}",
            f"{r.merge.peak_rss_mb:.0f} (+{r.merge.step_rss_bytes / MB:.0f})",
        )
    console = Console(file=io.StringIO(), width=160)
    with console.capture() as captured:
        console.print(table)
        if len(results) > 1:
            small, large = min(results, key=lambda r: r.input_bytes), max(results, key=lambda r: r.input_bytes)
            extra_records = max(large.records - small.records, 1)
            # From what each step added, so that a change in the processes' start-up memory cancels out.
            plan_growth = (large.plan.step_rss_bytes - small.plan.step_rss_bytes) / extra_records
            merge_growth = (large.merge.step_rss_bytes - small.merge.step_rss_bytes) / extra_records
            console.print(
                f"peak RSS, {large.size_mb} MB input / {small.size_mb} MB input: "
                f"planning x{large.plan.peak_rss_bytes / small.plan.peak_rss_bytes:.2f}, "
                f"merging x{large.merge.peak_rss_bytes / small.merge.peak_rss_bytes:.2f} "
                f"(growth a record: planning {plan_growth:.1f} B, merging {merge_growth:.1f} B)"
            )
        console.print("(+N): MB the step added to its process's peak, over what the process held when the step began")
        console.print(
            "planning includes dispatching the chord (to an in-memory broker); "
            "each merge sent no Celery message and read no task result"
        )
    return captured.get()
