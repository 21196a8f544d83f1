"""`manage.py demo`: start the stack, run a real embedding job end to end, print a summary."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.catalog.models import Model
from portal.devstack.demo import write_demo_dataset
from portal.devstack.stack import Stack, StackOptions
from portal.jobs.management.commands.submit import watch_job
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from portal.tenancy.services import tenant_get_or_create
from tasks.shared.storage import store_for


class Command(BaseCommand):
    help = "Run a real embedding job through the whole stack and print a summary."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--sentences", type=int, default=3000)
        parser.add_argument("--shard-size", type=int, default=None)
        parser.add_argument("--cpu-slots", type=int, default=None)
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the demo gives up")

    def handle(self, *args: Any, **options: Any) -> None:
        stack = Stack(StackOptions(portal=False, flower=False, cpu_slots=options["cpu_slots"], logs_to_files=True))
        self.stdout.write(
            f"starting the stack (embedded Redis where none is configured, control and cpu workers); "
            f"logs in {Path(settings.VAR_DIR) / 'logs'}"
        )
        stack.start()
        try:
            stack.wait_for_workers(queues={"control", "planning", "gpu.cpu"})
            dataset = write_demo_dataset(
                Path(settings.VAR_DIR) / "demo" / "sentences.jsonl", sentences=options["sentences"]
            )
            model = Model.objects.filter(is_default=True, enabled=True).first()
            if model is None:
                raise CommandError("no default model in the catalog; run migrations")
            job = job_submit(
                tenant=tenant_get_or_create(name="demo"),
                request=JobRequest(model_name=model.name, input_uri=str(dataset), shard_size=options["shard_size"]),
            )
            self.stdout.write(f"job {job.id}: {options['sentences']} sentences through {model.name}")
            started = time.monotonic()
            job = watch_job(job, timeout_s=options["timeout"])
            wall = time.monotonic() - started
        finally:
            stack.stop()
        self._summary(job, wall)
        if job.status != "succeeded":
            raise CommandError(f"demo job ended {job.status}: {job.error}")

    def _summary(self, job: Any, wall: float) -> None:
        records = job.succeeded_records + job.failed_records
        self.stdout.write("")
        self.stdout.write(f"status           {job.status}")
        self.stdout.write(
            f"records          {records} ({job.succeeded_records} succeeded, {job.failed_records} failed)"
        )
        self.stdout.write(f"shards           {job.shard_count} ({job.shard_cut})")
        self.stdout.write(f"seconds          {wall:.1f} from submission to ending")
        self.stdout.write(f"records/second   {records / wall:.0f}")
        self.stdout.write(f"output           {job.output_uri}")
        self.stdout.write("first lines:")
        with store_for(job.output_uri).open_read(job.output_uri) as output:
            for raw in itertools.islice(output, 3):
                line = json.loads(raw)
                embedding = line.get("response", {}).get("embedding", [])
                shown = ", ".join(f"{value:.4f}" for value in embedding[:4])
                self.stdout.write(f"  {line['custom_id']}: [{shown}, ...] ({len(embedding)} dimensions)")
