"""`manage.py bench` (`make bench`): the whole stack against the bare model loop, same sentences,
then planning and merging of large inputs.

Prints records per second of embedding jobs of 6,000, 20,000 and 100,000 sentences (`--sentences`)
through submit, plan, shards on warm workers and merge, and of `model.encode` in batches of 32 on the
same sentences (the limit: one single-thread process per core), and their ratio. Then, for
inputs of about 200 MB and 2 GB (`--io-sizes-mb`), the time, MB/s and peak RSS of planning and of
merging, each in its own process (see `bench.plan_merge`), and the merge of a Parquet output of
100,000 embeddings from the JSONL and from shard pieces (`--parquet-records`, `bench.parquet`). The
database's size per million finished shards, and the retention sweep that removes them, close the
whole-stack half (`--retention-shards`, `bench.retention`). `--skip-io` and `--only-io` run one half.
Last, chat lines sharing long system prompts with the transformers engine's prefix reuse off and on
(`--prefix-lines`, `bench.prefix`; `--only-prefix` runs it alone), and records/s of that engine with 0, 1, 4
and 16 LoRA adapters on one base model (`--lora-records`, `bench.lora`; `--only-lora` runs it alone). Then
Batchery with one vLLM slot against `vllm run-batch` on the same chat requests (`--vllm-requests`,
`--vllm-model-dir`, `bench.vllm_batch`; `--only-vllm` runs it alone).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection
from django.db.models import Sum

from bench.api import render_api, run_api_bench
from bench.bare import bare_limit_rate, bare_loop_rate
from bench.ceiling import render_ceiling, run_ceiling_bench
from bench.fairness import render_fairness, run_fairness_bench
from bench.first_result import FirstResult, first_result
from bench.fleet_scale import render_fleet, run_fleet_bench
from bench.job import timed_job
from bench.lora import render_lora, run_lora_bench
from bench.metrics import StackRun, instrumentation_seconds_per_shard, scrape_p99, stack_rate
from bench.parquet import render_parquet, run_parquet_bench
from bench.plan_merge import DEFAULT_SIZES_MB, bench_input, render_io_results, run_io_bench
from bench.prefix import render_prefix, run_prefix_bench
from bench.reconcile import render_reconcile, run_reconcile_bench
from bench.retention import render_retention, run_retention_bench
from bench.scheduler_scale import render_scheduler, run_scheduler_bench
from bench.vllm_batch import render_vllm_batch, run_vllm_batch_bench
from gpuworkers.settings import micro_batch_size
from portal.catalog.models import Model
from portal.devstack.demo import write_demo_dataset
from portal.devstack.embedded import start_embedded_redis
from portal.devstack.stack import Stack, StackOptions, repoint_celery_app
from portal.jobs.management.commands.submit import watch_job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.services import tenant_get_or_create


@contextmanager
def shared_broker() -> Iterator[None]:
    """One embedded Redis for every stack the benchmark starts, where no broker is configured.

    A stack that starts its own Redis points this process (and its Celery app) at it and stops it at
    the end; the next stack would find the first one's dead address. At the end the environment is
    as it was, so that nothing after it (the planning bench's processes) is pointed at a Redis gone.
    """
    if os.environ.get("CELERY_BROKER_URL"):
        yield
        return
    names = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    before = {name: os.environ.get(name) for name in names}
    redis = start_embedded_redis(Path(settings.VAR_DIR) / "redis")
    os.environ.update(dict.fromkeys(names, redis.url))
    repoint_celery_app()
    try:
        yield
    finally:
        redis.stop()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        repoint_celery_app()


SENTENCE_COUNTS = (6_000, 20_000, 100_000)

# The parts of the whole-stack half and the option that sizes each; 0 skips a part.
PARTS = (
    "sentences",
    "metrics-sentences",
    "fairness-slots",
    "ceiling-slots",
    "api-jobs",
    "reconcile-jobs",
    "retention-shards",
    "fleet-slots",
    "scheduler-jobs",
)


def ratio_target(sentences: int) -> float:
    """The whole stack's least ratio to the bare limit: 0.95 from 20,000 sentences, 0.90 below (a small
    job's first and last shards, when some slots idle, weigh more)."""
    return 0.95 if sentences >= 20_000 else 0.90


def rerun_line(**kept: int) -> str:
    """The command that runs only the parts in `kept` (`metrics_sentences=6000`), every other one at 0."""
    values = {part: kept.pop(part.replace("-", "_"), 0) for part in PARTS}
    if kept:
        raise ValueError(f"not a part of the benchmark: {', '.join(kept)}")
    return "rerun: python manage.py bench --skip-io " + " ".join(f"--{part} {value}" for part, value in values.items())


def sentence_counts(value: str) -> list[int]:
    """`6000,20000` -> [6000, 20000]: the whole-stack jobs' sizes; `0` runs none."""
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sentence counts separated by commas, got {value!r}") from None
    if counts == [0]:
        return []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sentence counts, or 0 to skip, got {value!r}")
    return counts


def sizes_mb(value: str) -> list[int]:
    """`200,2000` -> [200, 2000]: input sizes in MB for the I/O benchmark."""
    try:
        sizes = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MB sizes separated by commas, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive MB sizes, got {value!r}")
    return sizes


class Command(BaseCommand):
    help = "Benchmark a whole-stack embedding job against the bare model loop, then planning and merging."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--sentences",
            type=sentence_counts,
            default=list(SENTENCE_COUNTS),
            help="records of each job of the stack against the bare loop, separated by commas (default "
            "6000,20000,100000; 0: skip)",
        )
        parser.add_argument("--shard-size", type=int, default=None)
        # A slot per core: the fastest split of a CPU machine for this small model (see gpuworkers.slots).
        parser.add_argument("--cpu-slots", type=int, default=os.cpu_count() or 1)
        parser.add_argument(
            "--io-sizes-mb",
            type=sizes_mb,
            default=list(DEFAULT_SIZES_MB),
            help="input sizes of the planning and merging benchmark, in MB (default 200,2000)",
        )
        parser.add_argument(
            "--first-result-mb",
            type=int,
            default=2000,
            help="input size in MB of the first-result run on the warm stack (0: skip)",
        )
        parser.add_argument(
            "--metrics-sentences", type=int, default=6_000, help="job size of the metrics on/off comparison (0: skip)"
        )
        parser.add_argument(
            "--metrics-rounds", type=int, default=4, help="off/on pairs of the comparison; medians are compared"
        )
        parser.add_argument(
            "--fairness-slots", type=int, default=4, help="CPU slots of the scheduler's fairness run (0: skip)"
        )
        parser.add_argument(
            "--ceiling-slots", type=int, default=2, help="slots of the zero-cost-engine platform ceiling run (0: skip)"
        )
        parser.add_argument("--ceiling-records", type=int, default=100_000)
        parser.add_argument("--ceiling-shards", type=int, default=1000, help="one-record shards of the per-shard run")
        parser.add_argument("--no-ceiling-profile", action="store_true", help="skip the py-spy profile")
        parser.add_argument("--api-jobs", type=int, default=10_000, help="jobs in the API run's database (0: skip)")
        parser.add_argument("--api-clients", type=int, default=50)
        parser.add_argument("--api-seconds", type=float, default=10.0)
        parser.add_argument("--no-api-profile", action="store_true", help="skip the py-spy profile of the portal")
        parser.add_argument(
            "--api-portal-workers", type=int, default=StackOptions.portal_workers, help="gunicorn workers of the portal"
        )
        parser.add_argument(
            "--reconcile-jobs", type=int, default=100, help="running jobs of the reconciler sweep run (0: skip)"
        )
        parser.add_argument("--reconcile-shards", type=int, default=1000, help="dispatched shards a job")
        parser.add_argument(
            "--retention-shards",
            type=int,
            default=1_000_000,
            help="finished shard rows the retention sweep removes, sizes measured (0: skip)",
        )
        parser.add_argument("--retention-jobs", type=int, default=1000, help="jobs the retention run's shards are of")
        parser.add_argument(
            "--fleet-slots", type=int, default=1000, help="slots' heartbeats of the fleet reads run (0: skip)"
        )
        parser.add_argument(
            "--fleet-other-keys",
            type=int,
            default=100_000,
            help="other keys (results, progress) in the Redis beside the fleet's, for the fleet reads run",
        )
        parser.add_argument("--fleet-rounds", type=int, default=20, help="timed reads of each kind in the fleet run")
        parser.add_argument(
            "--scheduler-jobs", type=int, default=2000, help="running jobs of the scheduler tick run (0: skip)"
        )
        parser.add_argument("--scheduler-tenants", type=int, default=200, help="their tenants")
        parser.add_argument("--scheduler-slots", type=int, default=250, help="live slots of the tick's queue")
        parser.add_argument("--scheduler-waiting", type=int, default=50, help="shards waiting a job")
        parser.add_argument("--scheduler-ticks", type=int, default=50, help="timed ticks of each kind")
        parser.add_argument(
            "--parquet-records",
            type=int,
            default=100_000,
            help="embeddings of the Parquet output merge, from the JSONL and from pieces (0: skip)",
        )
        parser.add_argument(
            "--prefix-lines",
            type=int,
            default=2_000,
            help="chat lines sharing 20 system prompts, run with prefix reuse off and on (0: skip)",
        )
        parser.add_argument(
            "--lora-records",
            type=int,
            default=1_500,
            help="prompts run on the base model alone, then spread over 1, 4 and 16 LoRA adapters (0: skip)",
        )
        parser.add_argument(
            "--vllm-requests",
            type=int,
            default=5_000,
            help="chat requests run by `vllm run-batch` and by Batchery with one vLLM slot (0: skip)",
        )
        parser.add_argument(
            "--vllm-model-dir",
            type=Path,
            default=None,
            help="the model of that run: a directory with a config.json is used as given; any other gets the tiny "
            "test Llama built there (default: built under var/bench/vllm)",
        )
        halves = parser.add_mutually_exclusive_group()
        halves.add_argument("--skip-io", action="store_true", help="only the whole-stack benchmark")
        halves.add_argument("--only-io", action="store_true", help="only the planning and merging benchmark")
        halves.add_argument("--only-prefix", action="store_true", help="only the prefix reuse benchmark")
        halves.add_argument("--only-lora", action="store_true", help="only the LoRA adapters benchmark")
        halves.add_argument("--only-vllm", action="store_true", help="only Batchery against vllm run-batch")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["only_prefix"]:
            self.stdout.write(render_prefix(run_prefix_bench(lines=options["prefix_lines"])))
            return
        if options["only_lora"]:
            if options["lora_records"]:
                self.stdout.write(render_lora(run_lora_bench(records=options["lora_records"])))
            return
        call_command("migrate", verbosity=0)
        if options["only_vllm"]:
            self.vllm_bench(options)
            return
        if not options["only_io"]:
            with shared_broker():
                if options["sentences"]:
                    self.stack_benches(options)
                if options["metrics_sentences"]:
                    self.metrics_bench(options)
                if options["fairness_slots"]:
                    self.fairness_bench(options["fairness_slots"])
                self.platform_bench(options)
                if options["retention_shards"]:
                    self.retention_bench(options["retention_shards"], options["retention_jobs"])
                if options["fleet_slots"]:
                    self.fleet_bench(options)
                if options["scheduler_jobs"]:
                    self.stdout.write("")
                    ticks = run_scheduler_bench(
                        tenants=options["scheduler_tenants"],
                        jobs=options["scheduler_jobs"],
                        waiting_per_job=options["scheduler_waiting"],
                        slots=options["scheduler_slots"],
                        ticks=options["scheduler_ticks"],
                    )
                    self.stdout.write(render_scheduler(ticks))
        if not options["skip_io"]:
            self.io_bench(options["io_sizes_mb"])
            if options["parquet_records"]:
                self.stdout.write("")
                self.stdout.write(render_parquet(run_parquet_bench(records=options["parquet_records"])))
        if options["prefix_lines"]:
            self.stdout.write("")
            self.stdout.write(render_prefix(run_prefix_bench(lines=options["prefix_lines"])))
        if options["lora_records"]:
            self.stdout.write("")
            self.stdout.write(render_lora(run_lora_bench(records=options["lora_records"])))
        if not options["only_io"]:
            self.vllm_bench(options)

    def vllm_bench(self, options: dict[str, Any]) -> None:
        if not options["vllm_requests"]:
            return
        self.stdout.write("")
        with shared_broker():
            bench = run_vllm_batch_bench(
                requests=options["vllm_requests"], model_dir=options["vllm_model_dir"], say=self.stdout.write
            )
        self.stdout.write(render_vllm_batch(bench))

    def metrics_bench(self, options: dict[str, Any]) -> None:
        count = options["metrics_sentences"]
        bench_dir = Path(settings.VAR_DIR) / "bench"
        dataset = write_demo_dataset(bench_dir / f"sentences-{count}.jsonl", sentences=count)
        warmup = write_demo_dataset(bench_dir / "warmup.jsonl", sentences=400, seed=1)
        model = Model.objects.get(is_default=True, enabled=True).name
        self.stdout.write("")
        rounds = options["metrics_rounds"]
        self.stdout.write(f"monitoring: {count} sentences, metrics off and on (scraped every 1 s), {rounds} rounds ...")
        # Alternated in the order off, on, on, off, ...: neither side always runs first in its round
        # (the warmer page cache, the quieter minute).
        runs: dict[bool, list[StackRun]] = {False: [], True: []}
        for round_number in range(rounds):
            for on in (False, True) if round_number % 2 == 0 else (True, False):
                runs[on].append(
                    stack_rate(dataset=dataset, warmup=warmup, model=model, cpu_slots=options["cpu_slots"], metrics=on)
                )
        rates = {on: statistics.median(run.records_per_s for run in done) for on, done in runs.items()}
        self.stdout.write("timing 200 scrapes of a launcher with 8 slots ...")
        p50, p99 = scrape_p99(slots=8, count=200)
        last = runs[True][-1]
        micro_batches = math.ceil(last.shard_records / micro_batch_size())
        cost = instrumentation_seconds_per_shard(micro_batches=micro_batches)
        for on, label in ((False, "metrics off"), (True, "metrics on ")):
            each = ", ".join(f"{run.records_per_s:.1f}" for run in runs[on])
            self.stdout.write(f"{label}          {rates[on]:8.1f} records/s median  (runs: {each})")
        self.stdout.write(f"ratio on / off       {rates[True] / rates[False]:8.3f}  (target >= 0.99)")
        self.stdout.write(
            f"metrics per shard    {cost * 1e6:8.1f} us  ({micro_batches} micro-batches; the same run's shards took "
            f"{last.shard_seconds:.3f} s each: {cost / last.shard_seconds:.5%} of a shard)"
        )
        self.stdout.write(f"scrape, 8 slots      p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms")
        self.stdout.write(rerun_line(metrics_sentences=count) + f" --metrics-rounds {rounds}")

    def fairness_bench(self, slots: int) -> None:
        self.stdout.write("")
        figures = run_fairness_bench(slots=slots, say=self.stdout.write)
        self.stdout.write(render_fairness(figures))
        self.stdout.write(rerun_line(fairness_slots=slots))

    def fleet_bench(self, options: dict[str, Any]) -> None:
        self.stdout.write("")
        figures = run_fleet_bench(
            slots=options["fleet_slots"], other_keys=options["fleet_other_keys"], rounds=options["fleet_rounds"]
        )
        self.stdout.write(render_fleet(figures))
        self.stdout.write(
            rerun_line(fleet_slots=options["fleet_slots"]) + f" --fleet-other-keys {options['fleet_other_keys']}"
        )

    def platform_bench(self, options: dict[str, Any]) -> None:
        """The platform's own cost: the zero-cost-engine ceiling, the API under load, a reconciler sweep."""
        if not (options["ceiling_slots"] or options["api_jobs"] or options["reconcile_jobs"]):
            return  # every part skipped: nothing ran, so there is nothing to rerun
        if options["ceiling_slots"]:
            self.stdout.write("")
            ceiling = run_ceiling_bench(
                slots=options["ceiling_slots"],
                records=options["ceiling_records"],
                shards=options["ceiling_shards"],
                profile=not options["no_ceiling_profile"],
                say=self.stdout.write,
            )
            self.stdout.write(render_ceiling(ceiling))
        if options["api_jobs"]:
            self.stdout.write("")
            api = run_api_bench(
                jobs=options["api_jobs"],
                clients=options["api_clients"],
                seconds=options["api_seconds"],
                portal_workers=options["api_portal_workers"],
                profile=not options["no_api_profile"],
                say=self.stdout.write,
            )
            self.stdout.write(render_api(api))
        if options["reconcile_jobs"]:
            self.stdout.write("")
            self.stdout.write(
                f"reconcile: one sweep over {options['reconcile_jobs']} running jobs of "
                f"{options['reconcile_shards']:,} shards ..."
            )
            sweep = run_reconcile_bench(jobs=options["reconcile_jobs"], shards_per_job=options["reconcile_shards"])
            self.stdout.write(render_reconcile(sweep))
        self.stdout.write(
            rerun_line(
                ceiling_slots=options["ceiling_slots"],
                api_jobs=options["api_jobs"],
                reconcile_jobs=options["reconcile_jobs"],
            )
            + f" --reconcile-shards {options['reconcile_shards']}"
        )

    def retention_bench(self, shards: int, jobs: int) -> None:
        self.stdout.write("")
        if connection.vendor != "postgresql":
            # Its figures are PostgreSQL's table and index sizes, what a deployment sizes its disks by.
            self.stdout.write(
                f"retention: skipped, it measures PostgreSQL's tables and this database is {connection.vendor}; "
                "set DATABASE_URL to a PostgreSQL database to run it"
            )
            return
        self.stdout.write(render_retention(run_retention_bench(shards=shards, jobs=jobs, say=self.stdout.write)))
        self.stdout.write(rerun_line(retention_shards=shards) + f" --retention-jobs {jobs}")

    def io_bench(self, sizes: list[int]) -> None:
        self.stdout.write("")
        self.stdout.write(f"planning and merging inputs of {', '.join(f'{size} MB' for size in sizes)} ...")
        results = run_io_bench(sizes, say=self.stdout.write)
        self.stdout.write(render_io_results(results))
        self.stdout.write(f"rerun: python manage.py bench --only-io --io-sizes-mb {','.join(map(str, sizes))}")

    def stack_benches(self, options: dict[str, Any]) -> None:
        """A job of each size against the bare limit measured around it; the first result of a large
        input once, on the first size's warm stack."""
        ratios = [
            (count, self.stack_bench(options, count=count, first_result_mb=0 if i else options["first_result_mb"]))
            for i, count in enumerate(options["sentences"])
        ]
        if len(ratios) > 1:
            self.stdout.write("")
            for count, ratio in ratios:
                self.stdout.write(
                    f"ratio to the limit at {count:>7,} sentences {ratio:6.3f}  (target >= {ratio_target(count):.2f})"
                )

    def stack_bench(self, options: dict[str, Any], *, count: int, first_result_mb: int) -> float:
        """One job of `count` sentences through the whole stack; returns its ratio to the bare limit."""
        dataset = write_demo_dataset(Path(settings.VAR_DIR) / "bench" / f"sentences-{count}.jsonl", sentences=count)
        sentences = [json.loads(line)["input"] for line in dataset.read_text().splitlines()]
        model = Model.objects.get(is_default=True, enabled=True)
        batch_size = int(model.default_params.get("batch_size", 32))

        self.stdout.write(f"bare loop: model.encode over {count} sentences, batch size {batch_size} ...")
        bare = bare_loop_rate(sentences, source=model.source, batch_size=batch_size)
        cores = os.cpu_count() or 1
        self.stdout.write(f"bare limit: {cores} single-thread processes at once, a share of the sentences each ...")
        limit_before = bare_limit_rate(sentences, source=model.source, batch_size=batch_size, processes=cores)

        stack = Stack(StackOptions(portal=False, flower=False, cpu_slots=options["cpu_slots"], logs_to_files=True))
        stack.start()
        try:
            stack.wait_for_workers(queues={"control", "planning", "gpu.cpu"})
            tenant = tenant_get_or_create(name="bench")
            warmup = write_demo_dataset(Path(settings.VAR_DIR) / "bench" / "warmup.jsonl", sentences=400, seed=1)
            self.stdout.write("warming the workers up (each slot loads the model once) ...")
            watch_job(
                job_submit(
                    tenant=tenant, request=JobRequest(model_name=model.name, input_uri=str(warmup), shard_size=50)
                )
            )
            self.stdout.write(f"stack: {count} sentences through submit, plan, shards and merge ...")
            job, elapsed = timed_job(
                tenant=tenant, model_name=model.name, dataset=dataset, shard_size=options["shard_size"]
            )
            large: FirstResult | None = None
            if first_result_mb:
                path = bench_input(first_result_mb, Path(settings.VAR_DIR) / "bench")
                self.stdout.write(f"first result of a {first_result_mb} MB input on the warm stack ...")
                large = first_result(tenant=tenant, model_name=model.name, path=path)
        finally:
            stack.stop()
        # Measured again after the stack, and the two averaged: this machine's speed drifts by several
        # percent over minutes, and a baseline from one side of the run alone would count the drift.
        self.stdout.write("bare limit again, after the stack ...")
        limit_after = bare_limit_rate(sentences, source=model.source, batch_size=batch_size, processes=cores)
        limit = (limit_before + limit_after) / 2
        stack_rate = job.succeeded_records / elapsed
        compute = job.shards.aggregate(total=Sum("compute_seconds"))["total"] or 0.0
        self.stdout.write("")
        self.stdout.write(f"job                  {job.status}, {job.shard_count} shards ({job.shard_cut})")
        self.stdout.write(
            f"stack                {stack_rate:8.1f} records/s  ({elapsed:.1f} s, submit to merged output)"
        )
        slots = job.shards.values("worker").distinct().count()
        self.stdout.write(f"bare model loop      {bare:8.1f} records/s  (one process, torch's default threads)")
        self.stdout.write(
            f"bare limit           {limit:8.1f} records/s  ({cores} single-thread processes at once; "
            f"{limit_before:.1f} before the stack, {limit_after:.1f} after)"
        )
        self.stdout.write(
            f"ratio to the limit   {stack_rate / limit:8.3f}  (stack on {slots} slots / bare limit; "
            f"target >= {ratio_target(count):.2f})"
        )
        self.stdout.write(f"ratio to one process {stack_rate / bare:8.3f}  (stack / bare model loop)")
        self.stdout.write(f"engine time          {compute:8.1f} s summed over shards; the rest is overhead")
        first = job.shards.order_by("finished_at").values_list("finished_at", "record_count").first()
        if first is not None and first[0] is not None and job.finished_at is not None:
            # From submission, as `elapsed` is: a small input is checked whole before the job's row exists.
            seconds = (first[0] - job.finished_at).total_seconds() + elapsed
            self.stdout.write(f"first result         {seconds:8.2f} s  (the first shard's {first[1]} records; <= 1 s)")
        if large is not None:
            self.stdout.write(
                f"first result, {large.input_bytes / 1e9:.1f} GB {large.seconds:6.2f} s  "
                f"(the first shard's {large.shard_records} records, then cancelled; target <= 1 s)"
            )
        self.stdout.write(rerun_line(sentences=count))
        return stack_rate / limit
