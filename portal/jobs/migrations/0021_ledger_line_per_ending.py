"""One ledger line per ending of a job (its first, and each retry round's) where there was one per job.

The line's primary key changes (the job, to an id of its own), which no ALTER does on both PostgreSQL and
SQLite: the lines are copied into a new table as their jobs' round-0 lines, the adapter splits re-pointed at
the copies, the old table dropped and the new one renamed to it.
"""

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import OuterRef, Subquery

COPIED = [
    "tenant_id",
    "model_id",
    "period",
    "status",
    "records_succeeded",
    "records_failed",
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "gpu_seconds",
    "recorded_at",
    "cost",
]
BATCH = 2000


def copy_lines(apps, schema_editor):
    old = apps.get_model("jobs", "JobUsage")
    new = apps.get_model("jobs", "LedgerLine")
    splits = apps.get_model("jobs", "JobAdapterUsage")
    rows = old.objects.order_by("pk").values("job_id", *COPIED).iterator(chunk_size=BATCH)
    batch = []
    for row in rows:
        batch.append(new(round=0, **row))
        if len(batch) == BATCH:
            new.objects.bulk_create(batch)
            batch = []
    new.objects.bulk_create(batch)
    splits.objects.update(
        line=Subquery(new.objects.filter(job_id=OuterRef("usage_id"), round=0).values("pk")[:1])
    )


def refuse_with_lines(apps, schema_editor):
    # Going back would have to fold a retried job's lines into one, rewriting closed months' bills.
    if apps.get_model("jobs", "LedgerLine").objects.exists():
        raise RuntimeError("jobs 0021 cannot be unapplied while ledger lines exist: bills never change")


class Migration(migrations.Migration):
    dependencies = [
        ("catalog", "0001_initial"),
        ("jobs", "0020_ledger_cost_kept_job_protected"),
        ("tenancy", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="LedgerLine",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "round",
                    models.PositiveIntegerField(
                        default=0, help_text="The round that ended: 0 the job's first, n its n-th retry."
                    ),
                ),
                ("period", models.DateField(help_text="First day of the month the round ended in.")),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("queued", "Queued"),
                            ("planning", "Planning"),
                            ("running", "Running"),
                            ("paused", "Paused"),
                            ("merging", "Merging"),
                            ("cancelling", "Cancelling"),
                            ("succeeded", "Succeeded"),
                            ("partially_succeeded", "Partially Succeeded"),
                            ("failed", "Failed"),
                            ("cancelled", "Cancelled"),
                            ("expired", "Expired"),
                        ],
                        max_length=20,
                    ),
                ),
                ("records_succeeded", models.PositiveBigIntegerField(default=0)),
                ("records_failed", models.PositiveBigIntegerField(default=0)),
                ("prompt_tokens", models.PositiveBigIntegerField(default=0)),
                ("completion_tokens", models.PositiveBigIntegerField(default=0)),
                (
                    "cached_prompt_tokens",
                    models.PositiveBigIntegerField(
                        default=0, help_text="Of the prompt tokens, those served from a shared prefix's cache."
                    ),
                ),
                (
                    "gpu_seconds",
                    models.FloatField(default=0.0, help_text="Shard load and compute time times GPUs per replica."),
                ),
                ("recorded_at", models.DateTimeField()),
                (
                    "cost",
                    models.DecimalField(
                        blank=True,
                        decimal_places=10,
                        help_text="What the line costs, in BATCHERY_CURRENCY, priced when it was written at the prices "
                        "in force that day and never again; empty only on a line written before costs were kept, "
                        "priced on its first read.",
                        max_digits=20,
                        null=True,
                    ),
                ),
                (
                    "job",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="+", to="jobs.job"
                    ),
                ),
                (
                    "model",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="+", to="catalog.model"
                    ),
                ),
                (
                    "tenant",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT, related_name="+", to="tenancy.tenant"
                    ),
                ),
            ],
            options={
                "ordering": ["-recorded_at"],
                "indexes": [models.Index(fields=["tenant", "period"], name="jobs_ledger_tenant_period")],
                "constraints": [
                    models.UniqueConstraint(fields=("job", "round"), name="unique_ledger_line_per_round")
                ],
            },
        ),
        migrations.AddField(
            model_name="jobadapterusage",
            name="line",
            field=models.ForeignKey(
                null=True, on_delete=django.db.models.deletion.CASCADE, related_name="+", to="jobs.ledgerline"
            ),
        ),
        migrations.RunPython(copy_lines, refuse_with_lines),
        migrations.RemoveConstraint(model_name="jobadapterusage", name="unique_adapter_line_per_usage"),
        migrations.RemoveField(model_name="jobadapterusage", name="usage"),
        migrations.DeleteModel(name="JobUsage"),
        migrations.RenameModel(old_name="LedgerLine", new_name="JobUsage"),
        migrations.RenameField(model_name="jobadapterusage", old_name="line", new_name="usage"),
        migrations.AlterField(
            model_name="jobadapterusage",
            name="usage",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.CASCADE, related_name="adapters", to="jobs.jobusage"
            ),
        ),
        migrations.AddConstraint(
            model_name="jobadapterusage",
            constraint=models.UniqueConstraint(fields=("usage", "name"), name="unique_adapter_line_per_usage"),
        ),
        migrations.AlterField(
            model_name="jobusage",
            name="job",
            field=models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name="usage", to="jobs.job"),
        ),
        migrations.AlterField(
            model_name="jobusage",
            name="model",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="usage", to="catalog.model"
            ),
        ),
        migrations.AlterField(
            model_name="jobusage",
            name="tenant",
            field=models.ForeignKey(
                on_delete=django.db.models.deletion.PROTECT, related_name="usage", to="tenancy.tenant"
            ),
        ),
    ]
