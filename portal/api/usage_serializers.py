"""The ledger as /api/v1/usage/ answers it: lines per job with their cost, and totals per month and model."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.catalog.money import money
from portal.jobs.models import JobAdapterUsage, JobUsage


class MoneySerializer(serializers.Serializer):
    amount = serializers.CharField(help_text='A decimal string, rounded to the currency\'s minor unit, e.g. "12.34".')
    currency = serializers.CharField(help_text="ISO 4217 code: the deployment's one currency.")


def money_field(amount: Decimal) -> dict[str, str]:
    return money(amount).as_dict()


class JobCostSerializer(serializers.Serializer):
    final = serializers.BooleanField(
        help_text="True: the job has ended and this is its ledger line's cost; false: its ended shards' so far."
    )
    cost = MoneySerializer(help_text="At the prices in force the day its line was recorded; today's while it runs.")


class JobAdapterUsageSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobAdapterUsage
        fields = ["name", "records_succeeded", "records_failed", "prompt_tokens", "completion_tokens"]
        read_only_fields = fields


class JobUsageSerializer(serializers.ModelSerializer):
    """A ledger line, one per ending of a job (its first, round 0, and each retry round's); `context["costs"]`
    holds the lines' costs by line id (`portal.jobs.billing.usage_costs`)."""

    job = serializers.UUIDField(source="job_id", read_only=True)
    model = serializers.CharField(source="model.name", read_only=True)
    adapters = JobAdapterUsageSerializer(
        many=True,
        read_only=True,
        help_text="For a job that named LoRA adapters: its usage per adapter (name@version), and its base model's.",
    )
    cost = serializers.SerializerMethodField(
        help_text="At the prices in force the day the line was recorded; 0 where the model has none."
    )

    class Meta:
        model = JobUsage
        fields = [
            "job",
            "round",
            "model",
            "period",
            "status",
            "records_succeeded",
            "records_failed",
            "prompt_tokens",
            "completion_tokens",
            "cached_prompt_tokens",
            "gpu_seconds",
            "cost",
            "recorded_at",
            "adapters",
        ]
        read_only_fields = fields

    @extend_schema_field(MoneySerializer)
    def get_cost(self, usage: JobUsage) -> dict[str, str]:
        return money_field(self.context["costs"][usage.pk])


class ModelCostSerializer(serializers.Serializer):
    model = serializers.CharField(help_text="name@version.")
    cost = MoneySerializer()


class PeriodUsageSerializer(serializers.Serializer):
    period = serializers.DateField(help_text="First day of the month.")
    jobs = serializers.IntegerField()
    records_succeeded = serializers.IntegerField()
    records_failed = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    cached_prompt_tokens = serializers.IntegerField(
        help_text="Of the prompt tokens, those a shared prefix's cache served."
    )
    gpu_seconds = serializers.FloatField()
    cost = MoneySerializer(help_text="The sum of the month's lines' costs.")
    models = ModelCostSerializer(many=True, help_text="The month's cost per model, summing to `cost`.")


def period_rows(rows: Any, costs: Any) -> list[dict[str, Any]]:
    """`usage_per_month`'s rows with each month's cost (`portal.jobs.billing.cost_per_month`) beside them."""
    shaped = []
    for row in rows:
        period = costs.get(row["period"])
        shaped.append(
            {
                **row,
                "cost": money_field(period.cost if period else Decimal(0)),
                "models": [
                    {"model": name, "cost": money_field(amount)}
                    for name, amount in (period.models.items() if period else ())
                ],
            }
        )
    return shaped
