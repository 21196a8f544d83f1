"""`manage.py rerun JOB_ID [--model M] [--model-version V] [--params JSON]`: run a job's input again as a new
job, with changes, for comparison (`GET /api/v1/jobs/{new id}/comparison/`)."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.audit.cli import add_actor_argument
from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import SubmissionError
from portal.jobs.services.rerun import RerunChanges, job_rerun


class Command(BaseCommand):
    help = "Re-run a job's input as a new job, with another model, model version or params; prints the new job's id."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("job_id")
        parser.add_argument("--model", help="another catalog model of the same task")
        parser.add_argument("--model-version", help="a version of the model")
        parser.add_argument(
            "--params", help="a JSON object merged over the job's params (a key given as null removes it)"
        )
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            job = Job.objects.select_related("model", "tenant").get(pk=options["job_id"])
        except (Job.DoesNotExist, ValidationError):
            raise CommandError(f"no job {options['job_id']}") from None
        params = None
        if options["params"] is not None:
            try:
                params = json.loads(options["params"])
            except json.JSONDecodeError as exc:
                raise CommandError(f"--params is not JSON: {exc}") from None
            if not isinstance(params, dict):
                raise CommandError("--params must be a JSON object")
        changes = RerunChanges(model_name=options["model"], model_version=options["model_version"], params=params)
        try:
            rerun = job_rerun(job=job, actor=options["actor"], changes=changes)
        except QuotaExceeded as exc:
            raise CommandError(str(exc)) from None
        except SubmissionError as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None
        self.stdout.write(f"job {rerun.id} re-runs job {job.id} on {rerun.model.name}@{rerun.model.version}")
