"""A job is one dataset through one model; a shard is a contiguous slice of its records.

The database is the truth about both. Status changes go through `portal.jobs.transitions`,
which checks `Job.TRANSITIONS` and updates conditionally.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    PLANNING = "planning"
    RUNNING = "running"
    PAUSED = "paused"
    MERGING = "merging"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    PARTIALLY_SUCCEEDED = "partially_succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


FINAL_STATUSES = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.PARTIALLY_SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
)
SCHEDULABLE = (JobStatus.PLANNING, JobStatus.RUNNING)
"""Statuses whose pending shards are sent: a job's shards are sent while its planner still cuts more."""
SETTLING = (JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.PAUSED)
"""Statuses whose shards may still be sent or ending: a planning job's first shards run while its
planner cuts more, and a paused job's running shards finish."""
COMPARABLE_ENDINGS = frozenset({JobStatus.SUCCEEDED, JobStatus.PARTIALLY_SUCCEEDED})
"""Endings whose output holds a line for every record: a re-run's comparison is made between two such."""
# Endings from which `retry` re-runs the failed records.
RETRYABLE_STATUSES = frozenset({JobStatus.PARTIALLY_SUCCEEDED, JobStatus.FAILED, JobStatus.EXPIRED})


class Job(models.Model):
    # The one place that says which status may follow which.
    # Planning may start again after a planner crash; a finished job runs again on `retry`.
    TRANSITIONS: dict[str, frozenset[str]] = {
        JobStatus.QUEUED: frozenset({JobStatus.PLANNING, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}),
        JobStatus.PLANNING: frozenset(
            {JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
        ),
        JobStatus.RUNNING: frozenset({JobStatus.MERGING, JobStatus.FAILED, JobStatus.CANCELLING, JobStatus.PAUSED}),
        # Paused: no new shard starts. Resume runs it again; a deadline that passes ends it (merging).
        JobStatus.PAUSED: frozenset({JobStatus.RUNNING, JobStatus.MERGING, JobStatus.FAILED, JobStatus.CANCELLING}),
        JobStatus.MERGING: frozenset(
            {JobStatus.SUCCEEDED, JobStatus.PARTIALLY_SUCCEEDED, JobStatus.FAILED, JobStatus.EXPIRED}
        ),
        JobStatus.CANCELLING: frozenset({JobStatus.CANCELLED, JobStatus.FAILED}),
        JobStatus.SUCCEEDED: frozenset(),
        # A retry plans its round (`portal.execution.retry_round`), then runs it.
        JobStatus.PARTIALLY_SUCCEEDED: frozenset({JobStatus.PLANNING}),
        JobStatus.FAILED: frozenset({JobStatus.PLANNING}),
        JobStatus.CANCELLED: frozenset(),
        JobStatus.EXPIRED: frozenset({JobStatus.PLANNING}),
    }

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.PROTECT, related_name="jobs")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    model = models.ForeignKey("catalog.Model", on_delete=models.PROTECT, related_name="jobs")
    adapter = models.ForeignKey(
        "catalog.Adapter",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="jobs",
        help_text="The LoRA adapter the job names in place of its model (its base model), if any.",
    )
    adapters = models.JSONField(
        default=dict,
        blank=True,
        help_text="Every adapter the job or its records name: name -> {id, spec}; what each shard's message carries.",
    )
    rerun_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="reruns",
        help_text="The job this one re-runs (same input; its comparison report is against that job's output).",
    )
    status = models.CharField(max_length=20, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True)
    error = models.TextField(blank=True)

    input_uri = models.CharField(max_length=1000)
    input_bytes = models.PositiveBigIntegerField(default=0)
    output_uri = models.CharField(max_length=1000, blank=True)
    errors_uri = models.CharField(max_length=1000, blank=True)
    input_format = models.CharField(
        max_length=10, default="auto", help_text="auto (by name and content), jsonl, csv, tsv or parquet."
    )
    text_column = models.CharField(max_length=200, blank=True, help_text="CSV, TSV, Parquet: the input column.")
    id_column = models.CharField(max_length=200, blank=True, help_text="CSV, TSV, Parquet: the custom_id column.")
    output_format = models.CharField(
        max_length=10, choices=[("jsonl", "JSONL"), ("parquet", "Parquet")], default="jsonl"
    )
    params = models.JSONField(default=dict, blank=True)
    priority = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="0-9, at most the tenant's; empty: the tenant's priority."
    )
    shard_size = models.PositiveIntegerField(
        null=True, blank=True, help_text="Records per shard; empty: cut by cost to BATCHERY_TARGET_SHARD_SECONDS"
    )

    total_records = models.PositiveBigIntegerField(null=True, blank=True)
    succeeded_records = models.PositiveBigIntegerField(default=0)
    failed_records = models.PositiveBigIntegerField(default=0)
    shard_count = models.PositiveIntegerField(default=0)
    prefix_groups = models.PositiveIntegerField(
        default=0,
        help_text="Prefix groups the planner kept together; 0: each shard holds consecutive records.",
    )
    retry_round = models.PositiveIntegerField(default=0, help_text="0 until `retry` re-runs failed records.")
    model_digest = models.CharField(
        max_length=80, blank=True, help_text="The weights' digest the job was pinned to at submission; empty: any."
    )
    input_digest = models.CharField(
        max_length=80, blank=True, help_text="sha256: of the input's bytes as stored, read by the planner."
    )
    provenance = models.JSONField(
        default=dict, blank=True, help_text="How the output was made: the manifest.json written beside it."
    )
    deadline_at = models.DateTimeField(null=True, blank=True, help_text="Past it the job ends `expired`.")

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    pruned_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When retention removed its shard rows and events (BATCHERY_SHARD_RETENTION_DAYS); empty: kept.",
    )
    timeline = models.JSONField(
        null=True,
        blank=True,
        help_text="Its status changes as [status, ISO time] pairs, kept from its events when retention removed them.",
    )

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["tenant", "status"]),
            # The job list's page, newest first: without it each page sorts all of the tenant's jobs.
            models.Index(fields=["tenant", "-created_at"], name="jobs_job_tenant_created"),
            # The retention sweep's jobs, oldest ending first. Partial: the jobs already pruned, which
            # pile up forever, are not in it, so finding the next ones costs what is left to prune.
            models.Index(
                fields=["finished_at"], condition=models.Q(pruned_at__isnull=True), name="jobs_job_unpruned_finished"
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.id} ({self.status})"

    @classmethod
    def can_transition(cls, source: str, target: str) -> bool:
        return target in cls.TRANSITIONS.get(source, frozenset())

    @classmethod
    def sources_of(cls, target: str) -> list[str]:
        """Every status from which `target` may be reached."""
        return [source for source, targets in cls.TRANSITIONS.items() if target in targets]

    @property
    def is_finished(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def adapter_name(self) -> str:
        """The name, among `adapters`, of the adapter the job itself names; empty when it runs its model bare."""
        return next((name for name, entry in self.adapters.items() if entry.get("default")), "")

    @property
    def shard_cut(self) -> str:
        """How the input is cut, for people: "500 records per shard" or "cut by cost"."""
        return f"{self.shard_size:,} records per shard" if self.shard_size else "cut by cost"


class ShardStatus(models.TextChoices):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


UNSETTLED = (ShardStatus.PENDING, ShardStatus.DISPATCHED)
"""Shard statuses of a shard that has not ended: waiting to be sent, or sent."""


class Shard(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="shards")
    index = models.PositiveIntegerField()
    round = models.PositiveIntegerField(default=0, help_text="0 for the job's shards, n for its n-th retry.")
    first_record = models.PositiveBigIntegerField(help_text="0-based position of the shard's first record.")
    record_count = models.PositiveIntegerField()
    input_chars = models.PositiveBigIntegerField(default=0, help_text="Characters of the records' input text.")
    estimated_seconds = models.FloatField(null=True, blank=True, help_text="Compute seconds the planner expected.")
    input_uri = models.CharField(max_length=1000)
    prefix_uri = models.CharField(max_length=1000, help_text="Where attempts and the commit marker go.")
    status = models.CharField(max_length=20, choices=ShardStatus.choices, default=ShardStatus.PENDING)
    task_id = models.CharField(max_length=100, blank=True)
    speculative_task_id = models.CharField(
        max_length=100, blank=True, help_text="The one speculative copy sent while the shard straggled, if any."
    )
    dispatched_at = models.DateTimeField(null=True, blank=True)
    slot_queue = models.CharField(
        max_length=300,
        blank=True,
        help_text="The own queue of the slot its last dispatch went to (it held the job's adapters); empty: none.",
    )
    attempt = models.PositiveIntegerField(default=0, help_text="Times the shard was dispatched.")
    attempt_id = models.CharField(max_length=64, blank=True, help_text="The committed attempt.")
    output_uri = models.CharField(max_length=1000, blank=True)
    errors_uri = models.CharField(max_length=1000, blank=True)
    succeeded_records = models.PositiveIntegerField(default=0)
    failed_records = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_prompt_tokens = models.PositiveBigIntegerField(
        default=0, help_text="Of the prompt tokens, those served from a shared prefix's cache."
    )
    worker = models.CharField(max_length=200, blank=True)
    worker_pid = models.PositiveIntegerField(null=True, blank=True)
    cache_hit = models.BooleanField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    compute_seconds = models.FloatField(null=True, blank=True)
    load_seconds = models.FloatField(null=True, blank=True)
    error_codes = models.JSONField(default=dict, blank=True, help_text="Failed records per error code.")
    provenance = models.JSONField(
        default=dict,
        blank=True,
        help_text="How the committed attempt ran (`ShardManifest.provenance`) but the model's file list.",
    )
    adapter_usage = models.JSONField(
        default=dict, blank=True, help_text="Records and tokens per adapter name ('' for the base model)."
    )
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["job", "index"]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="unique_shard_index_per_job")]
        indexes = [
            # What a scheduler tick reads: each waiting job's unsettled shards by status and its first waiting
            # ones. Partial: the settled shards, nearly all rows, are not in it, so a tick costs what waits
            # and runs, not the history of the jobs it looks at.
            models.Index(
                fields=["job", "status", "index"],
                condition=models.Q(status__in=["pending", "dispatched"]),
                name="jobs_shard_unsettled",
            ),
        ]

    def __str__(self) -> str:
        return f"shard {self.index} of {self.job_id}"


class JobEvent(models.Model):
    """One status change of a job, written in the same transaction as the change: its timeline."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    status = models.CharField(max_length=20, choices=JobStatus.choices)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job", "at", "pk"]

    def __str__(self) -> str:
        return f"{self.job_id} -> {self.status} at {self.at:%H:%M:%S}"


class JobUsage(models.Model):
    """A ledger line: what one ending of a job used, its first (round 0) or a retry round's (round n), in the
    month that ending happened in.

    Written once, when that ending commits, and never rewritten: its `cost` is priced then, at the prices in
    force that day, and kept, so a bill's lines never change after the fact, whatever is retried, deleted or
    re-priced later. A job's totals are the sums of its lines. Its job cannot be deleted while a line exists."""

    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="usage")
    round = models.PositiveIntegerField(
        default=0, help_text="The round that ended: 0 the job's first, n its n-th retry."
    )
    tenant = models.ForeignKey("tenancy.Tenant", on_delete=models.PROTECT, related_name="usage")
    model = models.ForeignKey("catalog.Model", on_delete=models.PROTECT, related_name="usage")
    period = models.DateField(help_text="First day of the month the round ended in.")
    status = models.CharField(max_length=20, choices=JobStatus.choices)
    records_succeeded = models.PositiveBigIntegerField(default=0)
    records_failed = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    cached_prompt_tokens = models.PositiveBigIntegerField(
        default=0, help_text="Of the prompt tokens, those served from a shared prefix's cache."
    )
    gpu_seconds = models.FloatField(default=0.0, help_text="Shard load and compute time times GPUs per replica.")
    recorded_at = models.DateTimeField()
    cost = models.DecimalField(
        max_digits=20,
        decimal_places=10,
        null=True,
        blank=True,
        help_text="What the line costs, in BATCHERY_CURRENCY, priced when it was written at the prices in force "
        "that day and never again; empty only on a line written before costs were kept, priced on its first read.",
    )

    class Meta:
        ordering = ["-recorded_at"]
        indexes = [models.Index(fields=["tenant", "period"], name="jobs_ledger_tenant_period")]
        # One line per ending: a redelivered ending inserts nothing (`usage_record`).
        constraints = [models.UniqueConstraint(fields=["job", "round"], name="unique_ledger_line_per_round")]

    def __str__(self) -> str:
        return f"usage of {self.job_id}, round {self.round}"


class JobAdapterUsage(models.Model):
    """What one adapter (or the base model itself) did within a ledger line (one ending of a job)."""

    usage = models.ForeignKey(JobUsage, on_delete=models.CASCADE, related_name="adapters")
    adapter = models.ForeignKey(
        "catalog.Adapter", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage"
    )
    name = models.CharField(max_length=260, help_text="The adapter as `name@version`; the base model's name for none.")
    records_succeeded = models.PositiveBigIntegerField(default=0)
    records_failed = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["usage", "name"]
        constraints = [models.UniqueConstraint(fields=["usage", "name"], name="unique_adapter_line_per_usage")]

    def __str__(self) -> str:
        return f"{self.name} in {self.usage_id}"
