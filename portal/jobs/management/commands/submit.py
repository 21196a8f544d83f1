"""`manage.py submit --model NAME --input PATH_OR_URI [--shard-size N] [--wait | --dry-run]`."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.jobs.models import Job
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.selectors import job_progress
from portal.jobs.services.dry_run import DryRunReport, job_dry_run
from portal.jobs.services.request_checks import OUTPUT_FORMATS
from portal.jobs.services.submit import job_submit
from portal.tenancy.models import Tenant
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.formats.inputs import FORMATS


def watch_job(job: Job, *, poll_s: float = 0.5, timeout_s: float | None = None) -> Job:
    """Show a live progress bar until the job ends; return it as it ended."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(job.status, total=None)
        while True:
            job.refresh_from_db()
            progress = job_progress(job)
            bar.update(task, total=progress.total, completed=progress.done, description=f"{job.status:<20}")
            if job.is_finished:
                return job
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise TimeoutError(f"job {job.id} still {job.status} after {timeout_s:.0f}s")
            time.sleep(poll_s)


class Command(BaseCommand):
    help = "Submit a batch job; with --wait, show its progress and wait for its ending."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", required=True, help="catalog name, e.g. all-MiniLM-L6-v2")
        parser.add_argument("--model-version", default=None)
        parser.add_argument(
            "--model-digest", default="", help="Pin the job to these weights (a job manifest's weights_digest)."
        )
        parser.add_argument("--input", required=True, help="a path or URI (file://, s3://): JSONL, CSV, TSV, Parquet")
        parser.add_argument("--tenant", default="default", help="tenant to submit as (created if missing)")
        parser.add_argument(
            "--shard-size", type=int, default=None, help="records per shard (default: cut by estimated cost)"
        )
        parser.add_argument("--params", default="{}", help="JSON object of run-time parameters")
        parser.add_argument("--deadline", type=float, default=None, help="seconds until the job expires")
        parser.add_argument(
            "--format", default="auto", choices=FORMATS, help="input format (auto: by name and content)"
        )
        parser.add_argument("--text-column", default="", help="CSV, TSV, Parquet: the column holding the input")
        parser.add_argument("--id-column", default="", help="CSV, TSV, Parquet: the column holding the custom_id")
        parser.add_argument("--output-format", default="jsonl", choices=OUTPUT_FORMATS)
        parser.add_argument("--priority", type=int, default=None, help="0-9, at most the tenant's (default: it)")
        parser.add_argument("--wait", action="store_true", help="show progress and wait until the job ends")
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="report what the job would do (records, tokens, shards, cost, ETA, quota) and submit nothing; "
            "exits non-zero when it would be refused",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        request = job_request(options)
        if options["dry_run"]:
            self._dry_run(options["tenant"], request)
            return
        tenant = tenant_get_or_create(name=options["tenant"])
        try:
            job = job_submit(tenant=tenant, request=request)
        except SubmissionError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"job {job.id} queued ({job.shard_cut})")
        if not options["wait"]:
            return
        job = watch_job(job)
        self.stdout.write(
            f"job {job.id} {job.status}: {job.succeeded_records} succeeded, {job.failed_records} failed; "
            f"output {job.output_uri}"
        )
        if job.error:
            self.stdout.write(f"reason: {job.error}")
        if job.status == "failed":
            raise CommandError(f"job {job.id} failed")

    def _dry_run(self, tenant_name: str, request: JobRequest) -> None:
        # A dry run creates nothing, so not the tenant a real submission would create either.
        tenant = Tenant.objects.filter(name=tenant_name).first()
        if tenant is None:
            raise CommandError(f"no tenant named {tenant_name!r}; a dry run creates nothing, not even the tenant")
        try:
            report = job_dry_run(tenant=tenant, request=request)
        except SubmissionError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write("\n".join(report_lines(report)))
        if not report.accepted:
            raise CommandError("the job would be refused: see above")


def job_request(options: dict[str, Any]) -> JobRequest:
    """The request the command line states."""
    try:
        params = json.loads(options["params"])
    except json.JSONDecodeError as exc:
        raise CommandError(f"--params is not valid JSON: {exc}") from None
    return JobRequest(
        model_name=options["model"],
        model_version=options["model_version"],
        model_digest=options["model_digest"],
        input_uri=options["input"],
        params=params,
        shard_size=options["shard_size"],
        deadline_seconds=options["deadline"],
        input_format=options["format"],
        text_column=options["text_column"],
        id_column=options["id_column"],
        output_format=options["output_format"],
        priority=options["priority"],
    )


def report_lines(report: DryRunReport) -> list[str]:
    """A dry run's report for a terminal, a line per subject."""
    unit = report.unit
    lines = [
        "dry run: nothing was submitted",
        f"model      {report.model}",
        f"input      {report.input_bytes:,} bytes, {report.records:,} valid records",
    ]
    if (sample := report.sample) is not None:
        lines.append(
            f"sampled    read {sample.input_bytes_read:,} bytes until {sample.stopped_by}; the whole input "
            f"estimated at {report.estimated_records:,} records (x{sample.scale:,.3g} by {sample.basis})"
        )
    if report.problem_count:
        plural = "s" if report.problem_count != 1 else ""
        lines.append(f"problems   {report.problem_count:,} bad {unit}{plural}; a submission would be refused:")
        lines += [f"           {problem}" for problem in report.problems]
        if report.problem_count > len(report.problems):
            lines.append(f"           and {report.problem_count - len(report.problems):,} more")
    if report.input_tokens is None:
        lines.append("tokens     not counted: the model's engine has no tokenizer")
    else:
        lines.append(f"tokens     {report.input_tokens:,}")
    if (over := report.over_length) is not None:
        shown = ", ".join(str(line) for line in over.lines) + (", ..." if over.count > len(over.lines) else "")
        lines.append(
            f"too long   {over.count:,} records over the model's {over.max_tokens:,} tokens"
            + (f" ({unit}s {shown})" if over.count else "")
        )
    if (groups := report.prefix_groups) is not None:
        plural = "s" if groups.groups != 1 else ""
        lines.append(
            f"grouped    {groups.records:,} records in {groups.groups} group{plural} whose prompts begin alike, "
            "each in shards of its own"
        )
    shards = report.shards
    lines.append(f"shards     {shards.count:,}")
    if shards.listed:
        lines += [
            f"           {index:>4}: {shard.records:,} records, {_duration(shard.seconds)}"
            for index, shard in enumerate(shards.listed)
        ]
    elif shards.count:
        lines.append(
            f"           records {shards.min_records:,} / {shards.median_records:,.0f} / {shards.max_records:,}, "
            f"seconds {_duration(shards.min_seconds)} / {_duration(shards.median_seconds)} / "
            f"{_duration(shards.max_seconds)} (min / median / max)"
        )
    source = "learned from the model's finished shards" if report.observed else "a default rate: the model has not run"
    lines += [
        f"estimate   {_duration(report.estimated_seconds)} of compute, {report.estimated_gpu_seconds:,.1f} GPU-seconds"
        f" ({source})",
        f"queue      {report.queue}: {report.slots} slots, {_duration(report.backlog_seconds)} of work ahead, "
        f"your share {report.share:.0%}",
        f"eta        {_duration(report.eta_seconds)}",
    ]
    cost = report.cost
    if cost.priced:
        high = "no upper bound (its params do not cap its output)" if cost.high is None else f"{cost.high}"
        lines.append(f"cost       {cost.low} to {high} {cost.currency} at today's prices")
    else:
        lines.append("cost       none: the model has no price")
    if (budget := report.budget) is not None:
        verdict = f": REFUSED, {budget.refused}" if budget.refused else ""
        lines.append(
            f"budget     {budget.spent:.2f} of {budget.limit} {budget.currency} spent this month, "
            f"+{budget.adds} at least, {budget.left:.2f} left{verdict}"
        )
    for number, line in enumerate(report.quota):
        head = "quota      " if number == 0 else "           "
        adds = "not counted" if line.adds is None else f"+{line.adds:,.6g}"
        left = "" if line.left is None else f", {line.left:,.6g} left"
        verdict = f": REFUSED, {line.refused}" if line.refused else ""
        lines.append(f"{head}{line.quota}: {line.used:,.6g} of {line.limit:,} used, {adds}{left}{verdict}")
    lines.append("verdict    " + ("would be accepted" if report.accepted else "would be refused"))
    return lines


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"
