"""Ops state. The fleet is not stored in the database: slots publish heartbeats to Redis. `FleetSlot`
is a placeholder with no table that gives the admin its "Fleet" page under Ops, and its permissions.
`MetricSample` holds the control side's Prometheus counters and histogram buckets."""

from __future__ import annotations

from django.db import models


class FleetSlot(models.Model):
    class Meta:
        managed = False
        verbose_name = "fleet"
        verbose_name_plural = "fleet"
        default_permissions = ("view",)
        permissions = [("drain_slot", "Can drain a slot")]

    def __str__(self) -> str:
        return "fleet"


class MetricSample(models.Model):
    """One sample of a control-side counter or histogram, as /metrics exports it.

    Kept here rather than in a process's memory: it is written in the same transaction as the
    event it counts (a job's ending), so it counts each event once, survives restarts and reads
    the same whichever portal process answers the scrape. Rows grow with label combinations
    (tenants x models x outcomes), never with jobs.
    """

    name = models.CharField(max_length=120, help_text="Sample name, e.g. batchery_jobs_finished_total.")
    labels = models.CharField(max_length=1000, help_text="The labels as JSON with sorted keys.")
    value = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["name", "labels"], name="one_metric_sample_per_labels")]

    def __str__(self) -> str:
        return f"{self.name}{self.labels} = {self.value}"
