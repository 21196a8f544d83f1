"""`manage.py submit --model NAME --input PATH_OR_URI [--shard-size N] [--wait]`."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.jobs.models import Job
from portal.jobs.selectors import job_progress
from portal.jobs.services.submit import OUTPUT_FORMATS, SubmissionError, job_submit
from portal.tenancy.services import tenant_get_or_create
from tasks.formats.inputs import FORMATS


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
        parser.add_argument("--input", required=True, help="a path or URI (file://, s3://): JSONL, CSV, TSV, Parquet")
        parser.add_argument("--tenant", default="default", help="tenant to submit as (created if missing)")
        parser.add_argument("--shard-size", type=int, default=None, help="records per shard")
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

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            params = json.loads(options["params"])
        except json.JSONDecodeError as exc:
            raise CommandError(f"--params is not valid JSON: {exc}") from None
        tenant = tenant_get_or_create(name=options["tenant"])
        try:
            job = job_submit(
                tenant=tenant,
                model_name=options["model"],
                model_version=options["model_version"],
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
        except SubmissionError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"job {job.id} queued ({job.shard_size} records per shard)")
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
