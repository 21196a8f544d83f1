"""Batchery against vLLM's own batch runner (`make bench`; `manage.py bench --only-vllm`): one file of chat
requests in OpenAI's batch format, the same model and engine settings, through `vllm run-batch` (what a user
would run instead) and through Batchery with one vLLM slot, submitted with the official `openai` client.

- **run-batch** (`bench.vllm_run_batch`) runs as a user starts it, with the `vllm.LLM` arguments the slot's engine
  gives as flags and the slot's environment, and the scheduler limits of vLLM's offline `LLM` (which the slot's
  engine gets by itself; the runner would take its server's, smaller ones). Timed from its process's start to its
  output file's last write (start-up and model load included), and from the line its log writes once the engine
  is up to the same write.
- **Batchery** runs a stack (`portal.devstack.stack`) with one slot (a `cpu` slot on a host without a GPU, else
  the first GPU), the model warm: a warm-up batch runs first, which loads it and teaches the planner its cost.
  The measured batch is timed from just before its creation (`/v1/batches`, its file uploaded before) to its
  output file written (the batch's `finalized_at`). Its first result is its first shard's commit
  (`bench.first_result.first_committed`), from the same start.

Both sides' rates come from their own output files: lines answered, and the completion tokens of their
``usage``. Greedy decoding of the same prompts gives both the same tokens; the totals are printed side by side
(where they differ, tokens/s is the fairer figure). Each side's CPU, and what the rest of the machine took
meanwhile, are printed too: on a shared machine a side that ran beside another load is slowed by it. The model
is the tiny Llama of the tests, built on the fly, unless a directory with a `config.json` is given (a real model
on a GPU host).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import openai
from django.conf import settings

from bench.api import wait_ready
from bench.catalog import bench_vllm_model_register
from bench.first_result import first_committed
from bench.prefix import WORDS
from bench.py_spy import machine_busy_seconds, tree_cpu_seconds
from bench.vllm_feed import FeedRun, render_feed, run_feed_child
from bench.vllm_run_batch import (
    READY_LINE,
    Answers,
    CpuUse,
    RunBatchRun,
    offline_scheduler_limits,
    read_answers,
    run_vllm_run_batch,
    slot_engine_kwargs,
    slot_environment,
    slot_variables,
    vllm_version,
)
from gpuworkers.slots import Slot, plan_slots
from portal.devstack.embedded import free_port
from portal.devstack.stack import Stack, StackOptions
from portal.jobs.models import Job
from portal.openai_api.models import Batch
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Membership
from portal.tenancy.services import membership_add, tenant_get_or_create
from tests.support.tiny_models import build_tiny_llama

MODEL_NAME = "bench-vllm"
TENANT = "bench-vllm"
ENDPOINT: Final = "/v1/chat/completions"
LOAD_PARAMS: dict[str, Any] = {"block_size": 32, "max_model_len": 512}
"""The catalog's load params of the model: vLLM's CPU attention takes blocks of multiples of 32."""
WARMUP_REQUESTS = 200
ENDED = {"completed", "failed", "expired", "cancelled"}


@dataclass(frozen=True)
class BatcheryRun:
    seconds: float
    """Just before the batch's creation to its output file written (`Batch.finalized_at`)."""
    first_result_s: float
    first_shard_records: int
    warmup_requests: int
    shards: list[tuple[int, float, float, float]]
    """Each shard: records, and its start, end and compute seconds, the times from the batch's creation."""
    answers: Answers
    cpu: CpuUse
    """The stack's processes (portal, workers, slot) from the batch's creation until its end was seen."""

    @property
    def idle_between_shards_s(self) -> float:
        """Seconds between the first shard's start and the last one's end in which no shard ran."""
        idle, end = 0.0, None
        for _, start, finish, _ in sorted(self.shards, key=lambda shard: shard[1]):
            if end is not None and start > end:
                idle += start - end
            end = finish if end is None else max(end, finish)
        return idle


@dataclass(frozen=True)
class VllmBatchBench:
    requests: int
    max_tokens: int
    model_dir: Path
    model: str
    """What the model is, in words: the tiny Llama (built for the run, or by an earlier one), or given."""
    slot: str
    """The Batchery slot's device, in words."""
    engine: dict[str, Any]
    """The `vllm.LLM` arguments both sides ran with."""
    environment: dict[str, str]
    run_batch: RunBatchRun
    batchery: BatcheryRun
    same_replies: int = 0
    """Requests both sides answered with the same text."""
    versions: dict[str, str] = field(default_factory=dict)
    feed: list[FeedRun] = field(default_factory=list)
    """The engine one micro-batch at a time and queued ahead (`bench.vllm_feed`)."""


def run_vllm_batch_bench(
    *,
    requests: int,
    model_dir: Path | None = None,
    max_tokens: int = 16,
    warmup_requests: int = WARMUP_REQUESTS,
    say: Callable[[str], None],
) -> VllmBatchBench:
    """Both sides over the same `requests` chat requests of `max_tokens` greedy tokens each.

    `model_dir`: a directory holding a model (`config.json`) is used as given; one without (empty, or absent) gets
    the tiny Llama built there; None builds it under the benchmark's directory. Raises `RuntimeError` where
    run-batch fails or the Batchery batch does not complete.
    """
    bench_dir = Path(settings.VAR_DIR) / "bench" / "vllm"
    bench_dir.mkdir(parents=True, exist_ok=True)
    given = model_dir is not None and (model_dir / "config.json").exists()
    model_dir = model_dir or bench_dir / "tiny-llama"
    built = not (model_dir / "config.json").exists()
    model = "given" if given else f"the tiny Llama of the tests, built {'now' if built else 'by an earlier run'}"
    if built:
        say(f"vllm batch: building the tiny Llama in {model_dir} ...")
        # The model the vLLM tests run: heads of 64, which vLLM's CPU attention takes.
        build_tiny_llama(model_dir, attention_heads=1, positions=512)
    slot = plan_slots(gpus=None, gpus_per_worker=1, gpu_class=None, cpu_slots=1)[0]
    say("vllm batch: reading vLLM's offline scheduler limits for this host ...")
    load_params = {**LOAD_PARAMS, **offline_scheduler_limits()}
    engine = slot_engine_kwargs(load_params, on_cpu=not slot.gpus)
    environment = slot_environment(slot)
    input_path = requests_file(bench_dir / f"requests-{requests}.jsonl", requests, max_tokens=max_tokens)

    say(f"vllm batch: vllm run-batch over {requests:,} requests ...")
    run_batch = run_vllm_run_batch(
        input_path=input_path,
        output_path=bench_dir / f"run-batch-output-{requests}.jsonl",
        log_path=bench_dir / "run-batch.log",
        model_dir=model_dir,
        model_name=MODEL_NAME,
        engine=engine,
        environment=environment,
    )
    warmup_path = requests_file(bench_dir / "warmup.jsonl", warmup_requests, max_tokens=max_tokens, seed=1)
    batchery = run_batchery(
        slot=slot,
        model_dir=model_dir,
        load_params=load_params,
        input_path=input_path,
        warmup_path=warmup_path,
        warmup_requests=warmup_requests,
        say=say,
    )
    same = sum(text == batchery.answers.texts.get(custom_id) for custom_id, text in run_batch.answers.texts.items())
    say(f"vllm batch: the engine one micro-batch at a time and queued ahead, {requests:,} requests ...")
    feed = run_feed_child(model_dir, requests, load_params=load_params, environment=environment)
    return VllmBatchBench(
        requests=requests,
        max_tokens=max_tokens,
        model_dir=model_dir,
        model=model,
        slot=f"one cpu slot, {slot.torch_threads} threads" if not slot.gpus else f"one {slot.gpu_class} GPU slot",
        engine=engine,
        environment={name: environment[name] for name in sorted(slot_variables(slot))},
        run_batch=run_batch,
        batchery=batchery,
        same_replies=same,
        versions={"vllm": vllm_version()},
        feed=feed,
    )


def requests_file(path: Path, count: int, *, max_tokens: int, seed: int = 0) -> Path:
    """`count` chat requests in OpenAI's batch format (`request-0`...), each a short question of random words,
    greedy, `max_tokens` long."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for n in range(count):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": f"Question {n}: {question}?"}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            line = {"custom_id": f"request-{n}", "method": "POST", "url": ENDPOINT, "body": body}
            handle.write(json.dumps(line) + "\n")
    return path


def run_batchery(
    *,
    slot: Slot,
    model_dir: Path,
    load_params: Mapping[str, Any],
    input_path: Path,
    warmup_path: Path,
    warmup_requests: int,
    say: Callable[[str], None],
) -> BatcheryRun:
    """The warm-up batch, then the measured one, on a stack of one slot serving the model."""
    # The openai client's HTTP library logs each request at INFO: a poll every half second would drown the table.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    bench_vllm_model_register(name=MODEL_NAME, source=str(model_dir), gpu_class=slot.gpu_class, load_params=load_params)
    key = _api_key()
    address = f"127.0.0.1:{free_port()}"
    options = StackOptions(
        portal=True,
        portal_address=address,
        flower=False,
        cpu_slots=None if slot.gpus else 1,
        gpus=slot.cuda_visible_devices or None,
        metrics_port=free_port(),
        logs_to_files=True,
    )
    stack = Stack(options)
    try:
        stack.start()
        wait_ready(f"http://{address}", stack)
        stack.wait_for_workers(queues={"control", "planning", "validation", slot.queue})
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=120)
        say(f"vllm batch: Batchery warm-up, {warmup_requests} requests (the slot loads the model) ...")
        _, warmup, _ = _timed_batch(client, warmup_path, stack, timeout_s=900)
        if warmup.status != "completed":
            raise RuntimeError(f"the warm-up batch ended {warmup.status}: {warmup.errors}")
        say("vllm batch: Batchery, the same requests through /v1/files and /v1/batches, one slot ...")
        created, batch, cpu = _timed_batch(client, input_path, stack, timeout_s=3600)
        if batch.status != "completed":
            raise RuntimeError(f"the batch ended {batch.status}: {batch.errors}")
        lines = client.files.content(batch.output_file_id).text.splitlines()
        if batch.error_file_id:
            lines += client.files.content(batch.error_file_id).text.splitlines()
    finally:
        stack.stop()
    row = Batch.objects.select_related("job").get(pk=batch.id)
    assert row.finalized_at is not None and row.job is not None
    first = first_committed(row.job)
    if first is None:
        raise RuntimeError(f"batch {batch.id} completed with no committed shard")
    return BatcheryRun(
        seconds=row.finalized_at.timestamp() - created,
        first_result_s=first[0] - created,
        first_shard_records=first[1],
        warmup_requests=warmup_requests,
        shards=_shards(row.job, created),
        answers=read_answers(lines),
        cpu=cpu,
    )


def _api_key() -> str:
    tenant = tenant_get_or_create(name=TENANT)
    membership = Membership.objects.filter(tenant=tenant).first() or membership_add(
        tenant=tenant, username=f"{TENANT}-user", role=Membership.Role.MEMBER, actor_role=Membership.Role.OWNER
    )
    _, key = apikey_create(tenant=tenant, user=membership.user)
    return key


def _timed_batch(client: openai.OpenAI, path: Path, stack: Stack, *, timeout_s: float) -> tuple[float, Any, CpuUse]:
    """Upload `path`, create a batch of it and wait for its end: the clock just before the creation, the batch,
    and the CPU until its end was seen. Polled every half second: the end's time comes from the batch's row."""
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    own_before, machine_before = _stack_cpu_seconds(stack), machine_busy_seconds()
    created = time.time()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while batch.status not in ENDED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after {timeout_s:.0f} s")
        stack.check_alive()
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    cpu = CpuUse(time.time() - created, _stack_cpu_seconds(stack) - own_before, machine_busy_seconds() - machine_before)
    return created, batch, cpu


def _stack_cpu_seconds(stack: Stack) -> float:
    return sum(tree_cpu_seconds(process.pid) for process in stack.processes.values())


def _shards(job: Job, created: float) -> list[tuple[int, float, float, float]]:
    shards = job.shards.filter(started_at__isnull=False, finished_at__isnull=False).order_by("index")
    return [
        (
            shard.record_count,
            shard.started_at.timestamp() - created,
            shard.finished_at.timestamp() - created,
            shard.compute_seconds or 0.0,
        )
        for shard in shards
        if shard.started_at is not None and shard.finished_at is not None
    ]


def render_vllm_batch(bench: VllmBatchBench) -> str:
    run_batch, batchery = bench.run_batch, bench.batchery

    def row(label: str, seconds: float, answers: Answers, includes: str) -> str:
        return (
            f"  {label:<24} {seconds:8.2f} {_rate(seconds, answers.succeeded):10.1f} "
            f"{_rate(seconds, answers.completion_tokens):12.1f} {answers.completion_tokens:>13,} "
            f"{answers.errors:>6}  {includes}"
        )

    settings_text = ", ".join(
        f"{name} {value}" for name, value in bench.engine.items() if name != "structured_outputs_config"
    )
    lines = [
        f"vLLM batch: {bench.requests:,} chat requests (max_tokens {bench.max_tokens}, temperature 0), the same file "
        f"on both sides; {bench.versions.get('vllm', '')}; model {bench.model_dir} ({bench.model})",
        f"  engine, both sides: {settings_text}",
        f"  environment, both sides: {' '.join(f'{k}={v}' for k, v in bench.environment.items())}; Batchery on "
        f"{bench.slot}",
        f"  {'':<24} {'seconds':>8} {'requests/s':>10} {'output tok/s':>12} {'output tokens':>13} {'errors':>6}",
        row("vllm run-batch", run_batch.wall_s, run_batch.answers, "process start to output written (start-up and "
            "model load included)"),
    ]  # fmt: skip
    if run_batch.run_s is not None:
        lines.append(
            row("  less its start-up", run_batch.run_s, run_batch.answers, f"from its log's '{READY_LINE}' (engine up)")
        )
    lines.append(
        row(
            "Batchery, one vLLM slot",
            batchery.seconds,
            batchery.answers,
            f"batch creation to output file written; model warm (a warm-up batch of {batchery.warmup_requests} first)",
        )
    )
    ratios = [f"{_ratio(batchery, batchery.seconds, run_batch.wall_s, run_batch):.3f} against the whole run-batch"]
    if run_batch.run_s is not None:
        ratios.append(f"{_ratio(batchery, batchery.seconds, run_batch.run_s, run_batch):.3f} against it less start-up")
    lines.append(f"  ratio Batchery / run-batch (requests/s): {', '.join(ratios)}  (target >= 0.95)")
    same_tokens = run_batch.answers.completion_tokens == batchery.answers.completion_tokens
    lines.append(
        f"  output tokens: run-batch {run_batch.answers.completion_tokens:,}, Batchery "
        f"{batchery.answers.completion_tokens:,} ({'the same' if same_tokens else 'NOT the same: compare tokens/s'}); "
        f"prompt tokens {run_batch.answers.prompt_tokens:,} and {batchery.answers.prompt_tokens:,}; "
        f"same replies {bench.same_replies:,} of {bench.requests:,}"
    )
    lines.append(
        f"  first result {batchery.first_result_s:6.2f} s  (Batchery: the first shard's {batchery.first_shard_records} "
        "records committed, from the batch's creation; target <= 1 s)"
    )
    lines.append(
        f"  CPU: run-batch {run_batch.cpu.own_s:.1f} s (its processes, start-up included), Batchery "
        f"{batchery.cpu.own_s:.1f} s (the stack's processes); the rest of the machine kept "
        f"{run_batch.cpu.others_cores:.2f} cores busy during run-batch, {batchery.cpu.others_cores:.2f} during "
        f"Batchery (of {os.cpu_count()}; a loaded machine slows the side it loads)"
    )
    lines.append(_timeline(batchery))
    if bench.feed:
        lines.append(render_feed(bench.feed))
    lines.append(f"rerun: python manage.py bench --only-vllm --vllm-requests {bench.requests}")
    return "\n".join(lines)


def _rate(seconds: float, count: int) -> float:
    return count / seconds if seconds > 0 else float("nan")


def _ratio(batchery: BatcheryRun, batchery_s: float, run_batch_s: float, run_batch: RunBatchRun) -> float:
    """Batchery's requests/s over run-batch's."""
    return (batchery.answers.succeeded / batchery_s) / (run_batch.answers.succeeded / run_batch_s)


def _timeline(batchery: BatcheryRun) -> str:
    """Where Batchery's seconds went: before the first shard started, shards running, the slot idle between
    shards, after the last shard."""
    if not batchery.shards:
        return "  Batchery: no shard ran"
    first_start = min(start for _, start, _, _ in batchery.shards)
    last_end = max(end for _, _, end, _ in batchery.shards)
    compute = sum(seconds for _, _, _, seconds in batchery.shards)
    sizes = [records for records, _, _, _ in batchery.shards]
    shown = ", ".join(str(size) for size in sizes[:8]) + (", ..." if len(sizes) > 8 else "")
    return (
        f"  Batchery's {batchery.seconds:.1f} s: {first_start:.2f} s to the first shard's start, "
        f"{last_end - first_start:.1f} s of shards ({len(sizes)}: {shown} records; engine {compute:.1f} s; "
        f"the slot idle {batchery.idle_between_shards_s:.2f} s between them), "
        f"{batchery.seconds - last_end:.2f} s after the last (merge, output file)"
    )
