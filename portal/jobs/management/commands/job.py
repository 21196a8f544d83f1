"""`manage.py job show|cancel|pause|resume|retry JOB_ID`: what operators do to one job from a shell."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.audit.cli import add_actor_argument
from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded
from portal.jobs.selectors import job_progress
from portal.jobs.services.pause import CannotPause, job_pause, job_resume
from portal.jobs.services.retry import CannotRetry, job_retry
from portal.jobs.services.stop import CannotStop, job_cancel


class Command(BaseCommand):
    help = "Show, cancel, pause, resume or retry one job."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        for action, text in (
            ("show", "print the job's state"),
            ("cancel", "cancel a queued, running or paused job"),
            ("pause", "start no new shard of a running job; running shards finish"),
            ("resume", "run a paused job again"),
            ("retry", "run a finished job's failed records again, into the same output"),
        ):
            subparser = actions.add_parser(action, help=text)
            subparser.add_argument("job_id")
            if action != "show":
                add_actor_argument(subparser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            job = Job.objects.select_related("model", "tenant").get(pk=options["job_id"])
        except (Job.DoesNotExist, ValidationError):
            raise CommandError(f"no job {options['job_id']}") from None
        try:
            if options["action"] == "cancel":
                job = job_cancel(job=job, actor=options["actor"])
            elif options["action"] == "pause":
                job = job_pause(job=job, actor=options["actor"])
            elif options["action"] == "resume":
                job = job_resume(job=job, actor=options["actor"])
            elif options["action"] == "retry":
                job = job_retry(job=job, actor=options["actor"])
        except (CannotStop, CannotPause, CannotRetry, QuotaExceeded) as exc:
            raise CommandError(str(exc)) from None
        progress = job_progress(job)
        self.stdout.write(
            f"job {job.id} {job.status}: {progress.done}/{progress.total if progress.total is not None else '?'} "
            f"records done, {job.succeeded_records} succeeded, {job.failed_records} failed"
        )
        if job.error:
            self.stdout.write(f"reason: {job.error}")
