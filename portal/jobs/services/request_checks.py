"""A submission's checks before its input's lines are read: the model (or adapter) it names, its params,
its options, its input's place; what `job_submit` (`submit.py`) and the dry run (`dry_run.py`) share,
with the refusals of an input that cannot be read or whose lines are bad.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone

from gpuworkers.engines.request_params import check_request_params
from gpuworkers.engines.sampling import ParamError
from portal.catalog.adapters import adapter_lookup
from portal.catalog.models import Adapter, Model
from portal.catalog.selectors import models_for_tenant, tenant_model
from portal.jobs.adapters import JobAdapters, adapter_entry
from portal.jobs.input_display import hide_storage_root
from portal.jobs.models import Job
from portal.jobs.quota import INPUT_BYTES_QUOTA, input_bytes_exceeded
from portal.jobs.requests import InputTooLarge, JobRequest, SubmissionError
from portal.jobs.selectors import model_weights_digest
from portal.jobs.services.input_access import input_refusal
from portal.jobs.services.uploads import stored_upload_uri
from portal.jobs.storage_layout import errors_uri, output_uri
from portal.tenancy.models import Tenant
from tasks.shared.formats.compression import DecompressionLimitExceeded
from tasks.shared.formats.inputs import InputOptions, InputOptionsError
from tasks.shared.formats.jsonl import JsonlCheck
from tasks.shared.formats.records import input_field_for
from tasks.shared.storage import StorageError

OUTPUT_FORMATS = ("jsonl", "parquet")
# Bounds on what a request may ask for: each keeps a value within what the job's columns and the
# workers can hold, and names a limit a person can read in the API schema.
MAX_PARAMS_DEPTH = 32
"""Levels of nesting in params, the params object itself being the first."""
MAX_PARAMS_BYTES = 64 * 1024
PLATFORM_PARAMS: dict[str, tuple[type, float]] = {
    "micro_batch_size": (int, 1_000_000),
    "time_limit_base_s": (float, 7 * 24 * 3600),
    "time_limit_per_record_s": (float, 24 * 3600),
}
"""Params the platform itself reads when it sends and runs shards (not the model's): their type and
upper bound. A wrong one refused here would otherwise fail in the scheduler, for every job of the queue."""
"""The size of params as compact UTF-8 JSON."""
MAX_SHARD_SIZE = 1_000_000
"""Records per shard when the submitter chooses: a worker holds a whole shard's input in memory."""
MAX_DEADLINE_SECONDS = 365 * 24 * 3600
WEIGHTS_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
"""A year: a batch job's deadline is hours or days; the bound keeps the deadline a date."""


@dataclass(frozen=True)
class InputCheck:
    size: int
    """Bytes in the input."""
    records: int | None
    """Valid records, when the input was small enough to check at submission."""


def normalize_input_uri(value: str) -> str:
    """Accept a URI or a local path; a path becomes an absolute file:// URI, and a local file:// URI its
    real path (`..` and symbolic links resolved): the job keeps the path that was checked, which the
    planner opens without following links (`tasks.shared.storage.input_open`)."""
    if not value:
        raise SubmissionError("an input is required", field="input")
    parsed = urlparse(value)
    if parsed.scheme in ("", "file") and not value.startswith("file://"):
        return Path(value).expanduser().resolve().as_uri()
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(unquote(parsed.path)).resolve().as_uri()
    return value


def _resolve_model(tenant: Tenant, name: str, version: str | None) -> tuple[Model, Adapter | None]:
    """The newest enabled model of that name (and version) the tenant's quota allows, or the base model of the
    tenant's adapter of that name (and version) with the adapter. A model the quota excludes is refused as
    one that does not exist (`tenant_model`)."""
    model = tenant_model(tenant, name, version)
    adapter = None
    if model is None and (adapter := adapter_lookup(tenant, name, version=version)) is not None:
        model = adapter.base_model
    if model is None:
        known = ", ".join(sorted(set(models_for_tenant(tenant).values_list("name", flat=True))))
        raise SubmissionError(
            f"no enabled model or adapter named {name!r}; models available: {known or 'none'}", field="model"
        )
    return model, adapter


def pinned_weights_check(model: Model, digest: str) -> None:
    """A job pinned to weights by digest: refused where the digest is malformed, or where the fleet no longer
    has those weights (the model's last job ran others). A model no job has run yet is pinned as asked; its
    slots refuse to run the job on other weights."""
    if not WEIGHTS_DIGEST.fullmatch(digest):
        raise SubmissionError(
            f"model_digest must be 'sha256:' and 64 hex digits (a job manifest's weights_digest), not {digest!r}",
            field="model_digest",
        )
    current = model_weights_digest(model)
    if current and current != digest:
        raise SubmissionError(
            f"model {model.name}@{model.version} runs on weights {current} now, not {digest}: the fleet no longer "
            "has them (submit without model_digest, or pinned to the weights it has)",
            field="model_digest",
        )


@contextmanager
def input_errors() -> Iterator[None]:
    """Raise what reading an input throws as the `SubmissionError` that names it."""
    try:
        yield
    except InputOptionsError as exc:
        raise SubmissionError(str(exc), field=exc.option) from None
    except StorageError as exc:
        # A storage error names the stored URI: the tenant sees it without the platform's storage root.
        raise SubmissionError(f"cannot read the input: {hide_storage_root(str(exc))}", field="input") from None
    except DecompressionLimitExceeded as exc:
        if exc.setting == INPUT_BYTES_QUOTA:
            raise input_bytes_exceeded(int(exc.limit), str(exc)) from None
        raise InputTooLarge(str(exc), limit=exc.limit, setting=exc.setting) from None


def input_rejected(check: JsonlCheck) -> SubmissionError:
    """The refusal of an input whose check found bad lines, naming them."""
    summary = check.summary(limit=settings.BATCHERY_MAX_REPORTED_PROBLEMS)
    return SubmissionError(f"input rejected: {summary}", field="input", problems=check.problems)


def _check_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise SubmissionError("params must be a JSON object", field="params")
    if (problem := _params_shape_problem(params) or _platform_params_problem(params)) is not None:
        raise SubmissionError(problem, field="params")
    try:
        # As PostgreSQL will take it: no NaN or Infinity, no lone surrogate.
        size = len(json.dumps(params, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode())
    except (TypeError, ValueError) as exc:
        raise SubmissionError(f"params must hold only JSON values: {exc}", field="params") from None
    if size > MAX_PARAMS_BYTES:
        raise SubmissionError(f"params is {size} bytes as JSON, over the limit of {MAX_PARAMS_BYTES}", field="params")
    return dict(params)


def _platform_params_problem(params: Mapping[str, Any]) -> str | None:
    for name, (kind, most) in PLATFORM_PARAMS.items():
        if name not in params:
            continue
        value = params[name]
        is_number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not is_number or (kind is int and value != int(value)) or not 0 < value <= most:
            what = "a whole number" if kind is int else "a number"
            return (
                f"params.{name} must be {what} above 0 and at most {most:g}, not {json.dumps(value, default=str)[:40]}"
            )
    return None


def _params_shape_problem(params: Mapping[str, Any]) -> str | None:
    """Nesting past MAX_PARAMS_DEPTH, or a NUL character (PostgreSQL's jsonb refuses \\u0000).

    Walked with a stack, not recursion: the value may be nested as deep as the JSON parser allowed,
    deeper than encoding it (or this check, recursive) could go.
    """
    pending: list[tuple[Any, int]] = [(params, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return "params must not hold a NUL character (\\u0000)"
            continue
        if isinstance(value, Mapping):
            children = [*value.keys(), *value.values()]
        elif isinstance(value, list | tuple):
            children = list(value)
        else:
            continue
        if depth > MAX_PARAMS_DEPTH:
            return f"params is nested deeper than {MAX_PARAMS_DEPTH} levels"
        pending.extend((child, depth + 1) for child in children)
    return None


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check but its input's lines: what `job_submit` and the dry run go on from."""

    tenant: Tenant
    model: Model
    adapter: Adapter | None
    """The adapter the request names in place of a model (`model` is then its base model)."""
    input_uri: str
    """Normalized: a local path made an absolute file:// URI."""
    params: dict[str, Any]
    options: InputOptions
    output_format: str
    priority: int | None
    shard_size: int | None
    deadline_seconds: float | None
    model_digest: str = ""

    @property
    def input_field(self) -> str:
        """The record field the model reads."""
        return input_field_for(self.model.task)

    def adapters(self) -> JobAdapters:
        """The judge of the models the input's records name, knowing the request's own adapter."""
        entries = {} if self.adapter is None else {self.adapter.name: adapter_entry(self.adapter, default=True)}
        return JobAdapters(self.tenant, self.model, entries)

    def job(self, checked: InputCheck, *, job_id: str, user: User | None = None) -> Job:
        """The job as `job_submit` creates it, not saved: the dry run plans it without storing it."""
        return Job(
            id=job_id,
            tenant=self.tenant,
            created_by=user,
            model=self.model,
            adapter=self.adapter,
            input_uri=self.input_uri,
            input_bytes=checked.size,
            params=self.params,
            input_format=self.options.format,
            text_column=self.options.text_column or "",
            id_column=self.options.id_column or "",
            output_format=self.output_format,
            priority=self.priority,
            # None: the planner cuts by estimated cost (plan.py).
            shard_size=self.shard_size,
            total_records=checked.records,
            output_uri=output_uri(job_id),
            errors_uri=errors_uri(job_id),
            deadline_at=timezone.now() + dt.timedelta(seconds=self.deadline_seconds) if self.deadline_seconds else None,
            model_digest=self.model_digest,
        )


def submission_request(
    *,
    tenant: Tenant,
    request: JobRequest,
    input_roots: Sequence[str] | None = None,
    task: str | None = None,
) -> CheckedRequest:
    """Check a request but for its input's lines; raise `SubmissionError` naming what is wrong.

    `input_roots`, when given, confines the input to those URI prefixes: callers acting for a tenant
    (the API) pass them; the operators' CLI does not. `task`, when given, is the task the model must
    serve (an OpenAI endpoint needs one).
    """
    model, adapter = _resolve_model(tenant, request.model_name, request.model_version)
    if task is not None and model.task != task:
        raise SubmissionError(
            f"model {model.name!r} serves task {model.task!r}; this needs a {task!r} model", field="model"
        )
    job_params = _check_params(request.params)
    if "dimensions" in job_params and (problem := model.dimensions_problem(job_params["dimensions"])) is not None:
        raise SubmissionError(f"params.dimensions {problem}", field="params")
    try:
        check_request_params(model.engine, model.task, job_params, tool_parser=model.tool_parser)
    except ParamError as exc:
        raise SubmissionError(f"params.{exc}", field="params") from None
    try:
        options = InputOptions(
            format=request.input_format, text_column=request.text_column or None, id_column=request.id_column or None
        )
    except InputOptionsError as exc:
        raise SubmissionError(str(exc), field=exc.option) from None
    if request.output_format not in OUTPUT_FORMATS:
        raise SubmissionError(
            f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, not {request.output_format!r}",
            field="output_format",
        )
    if request.priority is not None and not 0 <= request.priority <= tenant.priority:
        raise SubmissionError(
            f"priority must be from 0 to {tenant.priority} (the tenant's own priority), not {request.priority}",
            field="priority",
        )
    if request.shard_size is not None and not 1 <= request.shard_size <= MAX_SHARD_SIZE:
        raise SubmissionError(
            f"shard_size must be a number of records from 1 to {MAX_SHARD_SIZE}, not {request.shard_size}",
            field="shard_size",
        )
    # Written so that NaN fails it too.
    if request.deadline_seconds is not None and not 0 < request.deadline_seconds <= MAX_DEADLINE_SECONDS:
        raise SubmissionError(
            f"deadline_seconds must be more than 0 and at most {MAX_DEADLINE_SECONDS} (a year), "
            f"not {request.deadline_seconds}",
            field="deadline_seconds",
        )
    if request.model_digest:
        pinned_weights_check(model, request.model_digest)
    try:
        uri = normalize_input_uri(stored_upload_uri(request.input_uri, tenant_id=tenant.pk))
    except ValueError as exc:
        raise SubmissionError(str(exc), field="input") from None
    if input_roots is not None and (refusal := input_refusal(uri, input_roots)):
        raise SubmissionError(refusal, field="input")
    return CheckedRequest(
        tenant=tenant,
        model=model,
        adapter=adapter,
        input_uri=uri,
        params=job_params,
        options=options,
        output_format=request.output_format,
        priority=request.priority,
        shard_size=request.shard_size,
        deadline_seconds=request.deadline_seconds,
        model_digest=request.model_digest,
    )
