"""The portal's forms: they check the shape of what was typed; `job_submit` checks the rest."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.conf import settings
from django.db.models import QuerySet

from portal.catalog.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from portal.catalog.models import Model
from portal.jobs.requests import JobRequest
from portal.jobs.services.request_checks import OUTPUT_FORMATS
from portal.tenancy.models import Membership
from portal.webhooks.models import EVENT_TYPES
from tasks.shared.formats.inputs import FORMATS

FORMAT_LABELS = {"auto": "Detect from name and content", "jsonl": "JSONL", "csv": "CSV", "tsv": "TSV"}


class SubmitForm(forms.Form):
    model = forms.ChoiceField(label="Model")
    file = forms.FileField(label="Input file", required=False)
    input_uri = forms.CharField(
        label="Storage URI",
        required=False,
        max_length=1000,
        widget=forms.TextInput(attrs={"placeholder": "s3://bucket/key.jsonl or file:///srv/data/input.jsonl"}),
    )
    params = forms.CharField(
        label="Parameters (JSON object)",
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "spellcheck": "false", "placeholder": '{"normalize": true}'}),
    )
    shard_size = forms.IntegerField(label="Shard size (records)", required=False, min_value=1)
    input_format = forms.ChoiceField(
        label="Input format", choices=[(name, FORMAT_LABELS.get(name, name.title())) for name in FORMATS]
    )
    text_column = forms.CharField(label="Text column", required=False, max_length=200)
    id_column = forms.CharField(label="ID column", required=False, max_length=200)
    output_format = forms.ChoiceField(
        label="Output format",
        choices=[(name, "JSONL" if name == "jsonl" else "JSONL + Parquet") for name in OUTPUT_FORMATS],
    )
    deadline_seconds = forms.IntegerField(label="Deadline (seconds from now)", required=False, min_value=1)
    priority = forms.IntegerField(
        label="Priority (0-9)",
        required=False,
        min_value=0,
        max_value=9,
        help_text="Lower it for background work; it cannot exceed your tenant's.",
    )

    def __init__(self, *args: Any, models: QuerySet[Model], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = {str(model.pk): model for model in models}
        field = self.fields["model"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = [(pk, f"{model.name} · v{model.version} · {model.task}") for pk, model in self.models.items()]
        default = next((pk for pk, model in self.models.items() if model.is_default), None)
        if default and not self.is_bound:
            self.initial.setdefault("model", default)

    def clean_params(self) -> dict[str, Any]:
        text = (self.cleaned_data.get("params") or "").strip()
        if not text:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
        if not isinstance(value, dict):
            raise forms.ValidationError('must be a JSON object, such as {"normalize": true}')
        return value

    def clean_file(self) -> Any:
        upload = self.cleaned_data.get("file")
        limit = settings.BATCHERY_MAX_UPLOAD_BYTES
        if upload is not None and upload.size is not None and upload.size > limit:
            raise forms.ValidationError(f"the file is {upload.size} bytes; uploads are limited to {limit} bytes")
        return upload

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        has_file, has_uri = bool(data.get("file")), bool((data.get("input_uri") or "").strip())
        if has_file == has_uri and not self.has_error("file"):
            self.add_error("file", "upload a file or give a storage URI (one of them)")
        return data

    @property
    def chosen_model(self) -> Model:
        return self.models[self.cleaned_data["model"]]

    def job_request(self, input_uri: str) -> JobRequest:
        """The cleaned request, its input at `input_uri` (the upload's, once stored, or the one given)."""
        data, model = self.cleaned_data, self.chosen_model
        return JobRequest(
            model_name=model.name,
            model_version=model.version,
            input_uri=input_uri,
            params=data["params"],
            shard_size=data.get("shard_size"),
            deadline_seconds=data.get("deadline_seconds"),
            priority=data.get("priority"),
            input_format=data["input_format"],
            text_column=data.get("text_column", "").strip(),
            id_column=data.get("id_column", "").strip(),
            output_format=data["output_format"],
        )


class ApiKeyForm(forms.Form):
    name = forms.CharField(
        label="Name", required=False, max_length=100, widget=forms.TextInput(attrs={"placeholder": "e.g. nightly-etl"})
    )
    expires_in_days = forms.IntegerField(
        label="Expires in (days)", required=False, min_value=1, max_value=3650, help_text="Empty: never."
    )


class InvitationForm(forms.Form):
    """Whom a tenant admin invites: a user name or an email address (or both), with a role."""

    username = forms.CharField(label="User name", required=False, max_length=150)
    email = forms.EmailField(label="or email", required=False)
    role = forms.ChoiceField(label="Role", choices=Membership.Role.choices, initial=Membership.Role.MEMBER)

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if not cleaned.get("username", "").strip() and not cleaned.get("email", "").strip():
            raise forms.ValidationError("Name the person to invite: a user name or an email address.")
        return cleaned


class WebhookEndpointForm(forms.Form):
    # A plain string: `webhook_endpoint_create` checks the URL (and single-label hosts an operator allows).
    url = forms.CharField(
        label="URL",
        max_length=2000,
        widget=forms.TextInput(attrs={"placeholder": "https://hooks.example.com/batchery"}),
    )
    event_types = forms.MultipleChoiceField(
        label="Events",
        choices=[(name, name) for name in EVENT_TYPES],
        initial=list(EVENT_TYPES),
        widget=forms.CheckboxSelectMultiple,
    )


class AdapterForm(forms.Form):
    """A LoRA adapter to register: its name, the base model it adapts, and PEFT's two files.

    Only the shape is checked here; `adapter_register` checks the files against the base model and refuses
    the upload whole, naming the field at fault.
    """

    name = forms.CharField(
        label="Name",
        max_length=100,
        help_text="How jobs and records name it, in place of a model.",
        widget=forms.TextInput(attrs={"placeholder": "e.g. support-bot"}),
    )
    base_model = forms.ChoiceField(label="Base model")
    version = forms.CharField(label="Version", max_length=50, initial="1")
    description = forms.CharField(
        label="Description", required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 2})
    )
    adapter_config = forms.FileField(label=CONFIG_FILE, help_text="PEFT's LoRA config.")
    adapter_model = forms.FileField(label=WEIGHTS_FILE, help_text="The LoRA weights; no other format is taken.")

    def __init__(self, *args: Any, base_models: list[Model], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        field = self.fields["base_model"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = [(model.name, f"{model.name} · v{model.version} · {model.task}") for model in base_models]
        self.fields["adapter_config"].widget.attrs["accept"] = ".json,application/json"
        self.fields["adapter_model"].widget.attrs["accept"] = ".safetensors"
