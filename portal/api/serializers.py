"""What the API reads and writes; business rules stay in the services."""

from __future__ import annotations

import uuid
from typing import Any

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.catalog.models import Adapter, Model
from portal.execution.decayed_usage import usage_by_class
from portal.jobs.input_display import tenant_input_uri, tenant_job_error
from portal.jobs.models import Job
from portal.jobs.requests import JobRequest
from portal.jobs.selectors import job_progress
from portal.jobs.services.request_checks import (
    MAX_DEADLINE_SECONDS,
    MAX_PARAMS_BYTES,
    MAX_PARAMS_DEPTH,
    MAX_SHARD_SIZE,
    OUTPUT_FORMATS,
)
from portal.tenancy.models import ApiKey, Invitation, Membership, Tenant
from portal.webhooks.models import EVENT_TYPES, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from tasks.shared.formats.inputs import FORMATS
from tasks.shared.formats.records import input_field_for


def _adapter_key(entry: dict[str, Any]) -> str:
    return f"{entry['spec']['name']}@{entry['spec']['version']}"


class ProgressSerializer(serializers.Serializer):
    total = serializers.IntegerField(allow_null=True, help_text="Records in the job, once planned.")
    done = serializers.IntegerField(help_text="Records finished, succeeded or failed.")
    failed = serializers.IntegerField()
    fraction = serializers.FloatField()


_DATETIME = serializers.DateTimeField()
"""Formats the datetimes of `JobSerializer`'s direct path as its generic path's fields do."""

_PK_PLACEHOLDER = uuid.UUID(int=0)
"""Stands for a job's id in a link reversed once for all jobs."""
_PK_TEXT = str(_PK_PLACEHOLDER)


class JobSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    model_version = serializers.CharField(source="model.version", read_only=True)
    error = serializers.SerializerMethodField()
    input_uri = serializers.SerializerMethodField(
        help_text="The input as given, or `upload://<name>` for an upload: never the platform's storage root."
    )
    progress = serializers.SerializerMethodField()
    output_url = serializers.SerializerMethodField()
    errors_url = serializers.SerializerMethodField()
    adapter = serializers.SerializerMethodField(
        help_text="The LoRA adapter (name@version) the job names in place of its model (`model` is its base model)."
    )
    adapters = serializers.SerializerMethodField(
        help_text="Every LoRA adapter (name@version) the job or its records name, as far as planning has read."
    )

    class Meta:
        model = Job
        fields = [
            "id",
            "status",
            "error",
            "model",
            "model_version",
            "adapter",
            "adapters",
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
            "prefix_groups",
            "total_records",
            "succeeded_records",
            "failed_records",
            "retry_round",
            "rerun_of",
            "progress",
            "output_url",
            "errors_url",
            "deadline_at",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One reverse (and one absolute URL) per link name and serializer, not per job: a list page made 100.
        self._link_templates: dict[str, str] = {}

    def to_representation(self, instance: Job) -> dict[str, Any]:
        # DRF's generic path walks a field object per field: on a page of 50 jobs that was most of the list's
        # time. The same values, read directly; a test holds it equal to the generic path.
        job = instance
        pk = str(job.id)  # formatted once: a page of 50 jobs formatted ids 300 times
        when = _DATETIME.to_representation
        links = job.is_finished and bool(job.shard_count)
        return {
            "id": pk,
            "status": job.status,
            "error": tenant_job_error(job),
            "model": job.model.name,
            "model_version": job.model.version,
            "adapter": self.get_adapter(job),
            "adapters": self.get_adapters(job),
            "input_uri": tenant_input_uri(job),
            "input_bytes": job.input_bytes,
            "params": job.params,
            "input_format": job.input_format,
            "text_column": job.text_column,
            "id_column": job.id_column,
            "output_format": job.output_format,
            "priority": job.priority,
            "shard_size": job.shard_size,
            "shard_count": job.shard_count,
            "prefix_groups": job.prefix_groups,
            "total_records": job.total_records,
            "succeeded_records": job.succeeded_records,
            "failed_records": job.failed_records,
            "retry_round": job.retry_round,
            "rerun_of": None if job.rerun_of_id is None else str(job.rerun_of_id),
            "progress": self._progress(job, pk),
            "output_url": self._link("output", pk) if links else None,
            "errors_url": self._link("errors", pk) if links else None,
            "deadline_at": None if job.deadline_at is None else when(job.deadline_at),
            "created_at": None if job.created_at is None else when(job.created_at),
            "started_at": None if job.started_at is None else when(job.started_at),
            "finished_at": None if job.finished_at is None else when(job.finished_at),
        }

    def get_adapter(self, job: Job) -> str | None:
        entry = job.adapters.get(job.adapter_name) if job.adapter_name else None
        return None if entry is None else _adapter_key(entry)

    def get_adapters(self, job: Job) -> list[str]:
        return sorted(_adapter_key(entry) for entry in job.adapters.values())

    def get_input_uri(self, job: Job) -> str:
        return tenant_input_uri(job)

    def get_error(self, job: Job) -> str:
        return tenant_job_error(job)

    @extend_schema_field(ProgressSerializer)
    def get_progress(self, job: Job) -> dict[str, Any]:
        return self._progress(job, str(job.pk))

    def _progress(self, job: Job, pk: str) -> dict[str, Any]:
        progress = job_progress(job, self.context.get("live_progress", {}).get(pk))
        return {
            "total": progress.total,
            "done": progress.done,
            "failed": progress.failed,
            "fraction": progress.fraction,
        }

    def _link(self, name: str, pk: str) -> str:
        templates = self._link_templates
        if name not in templates:
            path = reverse(f"api:job-{name}", kwargs={"pk": _PK_PLACEHOLDER})
            request = self.context.get("request")
            templates[name] = request.build_absolute_uri(path) if request is not None else path
        return templates[name].replace(_PK_TEXT, pk)

    @extend_schema_field(serializers.URLField(allow_null=True))
    def get_output_url(self, job: Job) -> str | None:
        return self._link("output", str(job.pk)) if job.is_finished and job.shard_count else None

    @extend_schema_field(serializers.URLField(allow_null=True))
    def get_errors_url(self, job: Job) -> str | None:
        return self._link("errors", str(job.pk)) if job.is_finished and job.shard_count else None


class ParamsField(serializers.JSONField):
    """A JSON field that answers 400, not 500, when its value is nested too deeply to parse or encode.

    A form field's JSON text is parsed here (a JSON body's, by the parser), and recursion runs out
    long before any real params would; the limits themselves are the submission service's.
    """

    default_error_messages = {"too_deep": "is nested too deeply to read"}

    def to_internal_value(self, data: Any) -> Any:
        try:
            return super().to_internal_value(data)
        except RecursionError:
            self.fail("too_deep")


class JobCreateSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=200, help_text="A catalog model's name.")
    model_version = serializers.CharField(max_length=50, required=False)
    model_digest = serializers.CharField(
        max_length=80,
        required=False,
        help_text="Pin the job to these weights (a job manifest's `weights_digest`, `sha256:...`): refused if the "
        "fleet no longer has them, and never run on others.",
    )
    file = serializers.FileField(required=False, help_text="The input JSONL, uploaded (multipart).")
    input_uri = serializers.CharField(
        max_length=1000, required=False, help_text="Or the input's storage URI, under a location the tenant may read."
    )
    params = ParamsField(
        required=False,
        help_text=f"Run-time parameters: a JSON object, nested at most {MAX_PARAMS_DEPTH} levels deep, "
        f"at most {MAX_PARAMS_BYTES} bytes as JSON.",
    )
    input_format = serializers.ChoiceField(
        choices=FORMATS, default="auto", help_text="auto: by the file's name and content; gzip and zstd detected."
    )
    text_column = serializers.CharField(max_length=200, required=False, help_text="CSV, TSV, Parquet: the input.")
    id_column = serializers.CharField(max_length=200, required=False, help_text="CSV, TSV, Parquet: the custom_id.")
    output_format = serializers.ChoiceField(choices=OUTPUT_FORMATS, default="jsonl")
    priority = serializers.IntegerField(
        min_value=0, max_value=9, required=False, help_text="At most the tenant's priority; default: the tenant's."
    )
    shard_size = serializers.IntegerField(
        min_value=1,
        max_value=MAX_SHARD_SIZE,
        required=False,
        help_text="Records per shard; omitted: shards of about equal estimated cost.",
    )
    deadline_seconds = serializers.FloatField(
        min_value=1, max_value=MAX_DEADLINE_SECONDS, required=False, help_text="Seconds until the job expires."
    )
    dry_run = serializers.BooleanField(
        default=False,
        help_text="Check the request and report what the job would do (200, a DryRunReport) without creating it; "
        "an uploaded file is not kept.",
    )

    def validate_params(self, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("file" in attrs) == ("input_uri" in attrs):
            raise serializers.ValidationError({"input_uri": "give exactly one of file (an upload) and input_uri"})
        return attrs

    def job_request(self, input_uri: str) -> JobRequest:
        """The validated request, its input at `input_uri` (the upload's, once stored, or the one given)."""
        data = self.validated_data
        return JobRequest(
            model_name=data["model"],
            model_version=data.get("model_version"),
            model_digest=data.get("model_digest", ""),
            input_uri=input_uri,
            params=data.get("params"),
            shard_size=data.get("shard_size"),
            deadline_seconds=data.get("deadline_seconds"),
            input_format=data["input_format"],
            text_column=data.get("text_column", ""),
            id_column=data.get("id_column", ""),
            output_format=data["output_format"],
            priority=data.get("priority"),
        )


class CatalogModelSerializer(serializers.ModelSerializer):
    gpu_class = serializers.CharField(source="gpu_class.name", read_only=True)
    input_field = serializers.SerializerMethodField(help_text="The record field this model reads.")
    matryoshka_dimensions = serializers.ListField(
        child=serializers.IntegerField(),
        read_only=True,
        help_text="Embedding sizes the model was trained for (Matryoshka); jobs may ask for `dimensions` up to the "
        "largest. Empty: its embeddings cannot be shortened.",
    )
    input_modalities = serializers.ListField(
        child=serializers.CharField(),
        read_only=True,
        help_text="Kinds of input the model takes in chat messages (text, image, audio, video); a record's media "
        "parts must be of these kinds.",
    )

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
            "matryoshka_dimensions",
            "input_modalities",
            "is_default",
        ]
        read_only_fields = fields

    def get_input_field(self, model: Model) -> str:
        return input_field_for(model.task)


class AdapterSerializer(serializers.ModelSerializer):
    base_model = serializers.CharField(source="base_model.name", read_only=True)
    shared = serializers.SerializerMethodField(help_text="True for an adapter the operators share with every tenant.")

    class Meta:
        model = Adapter
        fields = ["id", "name", "version", "description", "base_model", "rank", "size_bytes", "shared", "created_at"]
        read_only_fields = fields

    def get_shared(self, adapter: Adapter) -> bool:
        return adapter.owner_id is None


class AdapterCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100, help_text="How jobs and records name it, in place of a model.")
    base_model = serializers.CharField(max_length=200, help_text="The catalog model it adapts.")
    version = serializers.CharField(max_length=50, default="1")
    description = serializers.CharField(max_length=2000, default="", allow_blank=True)
    adapter_config = serializers.FileField(help_text="PEFT's adapter_config.json (a LoRA config).")
    adapter_model = serializers.FileField(help_text="PEFT's adapter_model.safetensors; no other weights format.")


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


class InvitationSerializer(serializers.ModelSerializer):
    """An invitation as its tenant's admins see it; the person joins only when they accept it."""

    inviter = serializers.CharField(source="inviter.username", read_only=True, default=None)
    status = serializers.CharField(read_only=True, help_text="pending, accepted, declined, revoked or expired.")

    class Meta:
        model = Invitation
        fields = ["id", "username", "email", "role", "status", "inviter", "created_at", "expires_at"]
        read_only_fields = ["id", "status", "inviter", "created_at", "expires_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs.get("username", "").strip() and not attrs.get("email", "").strip():
            raise serializers.ValidationError({"username": ["name the person to invite: a username or an email"]})
        return attrs


class InvitationCreatedSerializer(InvitationSerializer):
    accept_url = serializers.CharField(
        read_only=True, help_text="The link the invited person opens, signed in, to accept; shown this once."
    )

    class Meta(InvitationSerializer.Meta):
        fields = [*InvitationSerializer.Meta.fields, "accept_url"]


class TenantShareSerializer(serializers.ModelSerializer):
    """A tenant's share of the fleet, as operators set it."""

    recent_gpu_seconds = serializers.SerializerMethodField(
        help_text="GPU-seconds per GPU class as fair share weighs them now (decayed with the configured half-life)."
    )

    class Meta:
        model = Tenant
        fields = ["id", "name", "priority", "weight", "recent_gpu_seconds", "created_at"]
        read_only_fields = ["id", "name", "created_at"]

    @extend_schema_field(serializers.DictField(child=serializers.FloatField()))
    def get_recent_gpu_seconds(self, tenant: Tenant) -> dict[str, float]:
        return usage_by_class(tenant.fair_share_usage.all())


class WebhookEndpointSerializer(serializers.ModelSerializer):
    """An endpoint as listed: its secret is shown once, at creation, never here."""

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "url", "event_types", "enabled", "created_at"]
        read_only_fields = fields


class WebhookEndpointCreateSerializer(serializers.Serializer):
    # A plain string: the service checks the URL, including single-label hosts an operator allows.
    url = serializers.CharField(max_length=2000, help_text="http:// or https:// URL the events are POSTed to.")
    event_types = serializers.MultipleChoiceField(
        choices=EVENT_TYPES, required=False, allow_empty=False, help_text="Events to send; all of them if left out."
    )


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.CharField(
        read_only=True, help_text="The signing secret (Standard Webhooks, whsec_…); shown this once, never again."
    )

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]
        read_only_fields = fields


class WebhookAttemptSerializer(serializers.ModelSerializer):
    class Meta:
        model = WebhookAttempt
        fields = ["number", "started_at", "duration_ms", "status_code", "error"]
        read_only_fields = fields


class WebhookDeliverySerializer(serializers.ModelSerializer):
    attempts = WebhookAttemptSerializer(many=True, read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "event_id",
            "event_type",
            "payload",
            "status",
            "attempt_count",
            "next_attempt_at",
            "last_status_code",
            "last_error",
            "created_at",
            "delivered_at",
            "attempts",
        ]
        read_only_fields = fields
