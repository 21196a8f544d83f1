"""What the API reads and writes; business rules stay in the services."""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.catalog.models import Model
from portal.jobs.models import Job, JobUsage
from portal.jobs.selectors import job_progress
from portal.jobs.services.submit import OUTPUT_FORMATS
from portal.tenancy.models import ApiKey, Membership
from tasks.formats.inputs import FORMATS
from tasks.formats.records import input_field_for


class ProgressSerializer(serializers.Serializer):
    total = serializers.IntegerField(allow_null=True, help_text="Records in the job, once planned.")
    done = serializers.IntegerField(help_text="Records finished, succeeded or failed.")
    failed = serializers.IntegerField()
    fraction = serializers.FloatField()


class JobSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    model_version = serializers.CharField(source="model.version", read_only=True)
    progress = serializers.SerializerMethodField()
    output_url = serializers.SerializerMethodField()
    errors_url = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "status",
            "error",
            "model",
            "model_version",
            "input_uri",
            "input_bytes",
            "params",
            "input_format",
            "text_column",
            "id_column",
            "output_format",
            "priority",
            "shard_size",
            "shard_count",
            "total_records",
            "succeeded_records",
            "failed_records",
            "retry_round",
            "progress",
            "output_url",
            "errors_url",
            "deadline_at",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields

    @extend_schema_field(ProgressSerializer)
    def get_progress(self, job: Job) -> dict[str, Any]:
        progress = job_progress(job)
        return {
            "total": progress.total,
            "done": progress.done,
            "failed": progress.failed,
            "fraction": progress.fraction,
        }

    def _link(self, job: Job, name: str) -> str | None:
        if not job.is_finished or not job.shard_count:
            return None
        path = reverse(f"api:job-{name}", kwargs={"pk": job.pk})
        request = self.context.get("request")
        return request.build_absolute_uri(path) if request is not None else path

    @extend_schema_field(serializers.URLField(allow_null=True))
    def get_output_url(self, job: Job) -> str | None:
        return self._link(job, "output")

    @extend_schema_field(serializers.URLField(allow_null=True))
    def get_errors_url(self, job: Job) -> str | None:
        return self._link(job, "errors")


class JobCreateSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=200, help_text="A catalog model's name.")
    model_version = serializers.CharField(max_length=50, required=False)
    file = serializers.FileField(required=False, help_text="The input JSONL, uploaded (multipart).")
    input_uri = serializers.CharField(
        max_length=1000, required=False, help_text="Or the input's storage URI, under a location the tenant may read."
    )
    params = serializers.JSONField(required=False, help_text="Run-time parameters (a JSON object).")
    input_format = serializers.ChoiceField(
        choices=FORMATS, default="auto", help_text="auto: by the file's name and content; gzip and zstd detected."
    )
    text_column = serializers.CharField(max_length=200, required=False, help_text="CSV, TSV, Parquet: the input.")
    id_column = serializers.CharField(max_length=200, required=False, help_text="CSV, TSV, Parquet: the custom_id.")
    output_format = serializers.ChoiceField(choices=OUTPUT_FORMATS, default="jsonl")
    priority = serializers.IntegerField(
        min_value=0, max_value=9, required=False, help_text="At most the tenant's priority; default: the tenant's."
    )
    shard_size = serializers.IntegerField(min_value=1, required=False)
    deadline_seconds = serializers.FloatField(min_value=1, required=False)

    def validate_params(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("file" in attrs) == ("input_uri" in attrs):
            raise serializers.ValidationError({"input_uri": "give exactly one of file (an upload) and input_uri"})
        return attrs


class CatalogModelSerializer(serializers.ModelSerializer):
    gpu_class = serializers.CharField(source="gpu_class.name", read_only=True)
    input_field = serializers.SerializerMethodField(help_text="The record field this model reads.")

    class Meta:
        model = Model
        fields = [
            "id",
            "name",
            "version",
            "description",
            "engine",
            "task",
            "input_field",
            "gpu_class",
            "gpus_per_replica",
            "default_params",
            "is_default",
        ]
        read_only_fields = fields

    def get_input_field(self, model: Model) -> str:
        return input_field_for(model.task)


class JobUsageSerializer(serializers.ModelSerializer):
    job = serializers.UUIDField(source="job_id", read_only=True)
    model = serializers.CharField(source="model.name", read_only=True)

    class Meta:
        model = JobUsage
        fields = [
            "job",
            "model",
            "period",
            "status",
            "records_succeeded",
            "records_failed",
            "prompt_tokens",
            "completion_tokens",
            "gpu_seconds",
            "recorded_at",
        ]
        read_only_fields = fields


class PeriodUsageSerializer(serializers.Serializer):
    period = serializers.DateField(help_text="First day of the month.")
    jobs = serializers.IntegerField()
    records_succeeded = serializers.IntegerField()
    records_failed = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    gpu_seconds = serializers.FloatField()


class ApiKeySerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "user", "created_at", "expires_at", "revoked_at", "last_used_at"]
        read_only_fields = ["id", "prefix", "user", "created_at", "revoked_at", "last_used_at"]


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself; shown this once, never again.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class MembershipSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", max_length=150)

    class Meta:
        model = Membership
        fields = ["id", "username", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class MembershipRoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Membership.Role.choices)
