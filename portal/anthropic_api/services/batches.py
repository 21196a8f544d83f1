"""`/v1/messages/batches`: a message batch is checked request by request, written as a Batchery job's input
and submitted as a job of task `chat` (so the same fair share, quotas and webhooks apply); it is cancelled
through its job and deleted, with what it stored, once it has ended.

As Anthropic's API does, only what malforms the batch is refused at creation, naming the request's index and
field (`requests.3.custom_id`): the body's `requests`, a request that is not `{custom_id, params: {...}}`, a
duplicate custom_id, the limits. Anything wrong inside one request's `params` (`params.max_tokens`, a model
the catalog does not hold...) lets the batch be created: that request is written as a refused record
(`tasks.shared.formats.records.REFUSED_FIELD`), which the slot settles as an error without running it, so it
comes back `errored` in the results, in its place, while the others run.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from typing import Any

import orjson
from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from gpuworkers.engines.media import MediaPolicy, messages_media_problem
from gpuworkers.engines.request_params import check_request_params
from gpuworkers.engines.sampling import ParamError
from portal.anthropic_api.formats.requests import (
    ChatRequest,
    RequestRefused,
    anthropic_field,
    convert_request,
    request_part,
    request_parts,
)
from portal.anthropic_api.models import MessageBatch
from portal.anthropic_api.selectors import processing_status
from portal.anthropic_api.storage import message_batch_input, message_batch_prefix
from portal.catalog.models import Model
from portal.jobs.adapters import model_runs_on
from portal.jobs.models import Job
from portal.jobs.quota import QuotaExceeded
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.stop import job_cancel
from portal.jobs.services.submit import job_submit
from portal.jobs.storage_layout import job_root
from portal.tenancy.models import ApiKey, Tenant
from tasks.shared.formats.records import REFUSED_FIELD
from tasks.shared.storage import store_for

logger = logging.getLogger(__name__)

BATCH_LIFETIME = dt.timedelta(hours=24)
"""Anthropic's: a batch not ended within 24 hours of its creation expires (its job's deadline)."""
MAX_REQUESTS = 100_000
"""Anthropic's limit on requests in one batch."""
CHAT_TASK = "chat"


class MessageBatchRefused(Exception):
    """The request cannot be served; `field` names what is wrong, e.g. `requests.3.params.max_tokens`."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def batch_model(tenant: Tenant, name: str) -> Model | None:
    """The catalog model a request naming ``name`` runs on (a model of that name, or the base model of a LoRA
    adapter of it the tenant may use), or None for a name the catalog does not hold.

    The one place a request's model name is resolved: every request of a batch must run on the model of the
    batch's job. A model outside the tenant's quota is a name the catalog does not hold.
    """
    return model_runs_on(tenant, name)


def _refused_param(error: ParamError) -> RequestRefused:
    # The engine names its own params (`stop must be ...`): said again in the request's words.
    field = anthropic_field(error.field)
    message = str(error)
    if message.startswith(error.field):
        message = field + message[len(error.field) :]
    return RequestRefused(f"params.{field}", message)


class _BatchWriter:
    """Checks the requests one by one and writes each as a record of the job's input as it goes: a request whose
    params cannot run as a refused record (`REFUSED_FIELD`), which errors alone in the results."""

    def __init__(self, tenant: Tenant, version: str) -> None:
        self.tenant = tenant
        self.version = version
        self.model: Model | None = None
        """The batch's model: the first chat model of the catalog a request names (or names an adapter of)."""
        self._model_index = 0
        self.params: dict[str, Any] = {}
        """The job's params: the first request's that runs."""
        self.first_run: int | None = None
        """The index of the first request that runs; None while every request so far is refused."""
        self.count = 0
        self._custom_ids: dict[str, int] = {}
        self._runs_on: dict[str, Model | None] = {}
        """What each model name given so far runs on (None: nothing the tenant may use)."""
        self._media: MediaPolicy | None = None
        """What the batch's model may be given in its messages, once a request named it."""

    def record(self, index: int, request: Any) -> bytes:
        """The request's record, newline-terminated; raises `MessageBatchRefused` where it malforms the batch."""
        try:
            custom_id, params = request_parts(request)
        except RequestRefused as exc:
            raise MessageBatchRefused(exc.message, field=f"requests.{index}.{exc.field}".rstrip(".")) from None
        first = self._custom_ids.setdefault(custom_id, index)
        if first != index:
            raise MessageBatchRefused(
                f"{custom_id!r} is already the custom_id of requests.{first}; each request needs its own",
                field=f"requests.{index}.custom_id",
            )
        self.count += 1
        try:
            record = self._runnable(index, convert_request(custom_id, params, version=self.version))
        except RequestRefused as exc:
            # As Anthropic answers it: the batch is created, and this request errors in its results.
            record = {"custom_id": custom_id, REFUSED_FIELD: f"{exc.field}: {exc.message}"}
        return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)

    def _runnable(self, index: int, converted: ChatRequest) -> dict[str, Any]:
        """The record of a request that runs; raises `RequestRefused` for one that cannot."""
        model = self._model(index, converted)
        self._check_media(converted, model)
        try:
            check_request_params(model.engine, model.task, converted.params, tool_parser=model.tool_parser)
        except ParamError as exc:
            raise _refused_param(exc) from None
        record: dict[str, Any] = {"custom_id": converted.custom_id, "messages": converted.messages}
        if converted.model != model.name:
            record["model"] = converted.model  # an adapter of the batch's model: the record runs with it
        if self.first_run is None:
            self.first_run, self.params = index, converted.params
        elif converted.params != self.params:
            # As the OpenAI conversion writes it: a null stands for a job param this request leaves out.
            record["params"] = {**dict.fromkeys(self.params), **converted.params}
        return record

    def _check_media(self, converted: ChatRequest, model: Model) -> None:
        """Refuse an image the model does not take, or one over the bounds (`gpuworkers.engines.media`)."""
        if self._media is None:
            self._media = MediaPolicy.configured(model.input_modalities)
        problem = messages_media_problem(converted.messages, self._media)
        if problem is not None:
            message = problem.message.removeprefix(problem.where).lstrip()
            raise RequestRefused(request_part(problem.where, converted), message)

    def _model(self, index: int, converted: ChatRequest) -> Model:
        """The model the request runs on: the one it names, or the base model of the adapter it names."""
        field = "params.model"
        if converted.model in self._runs_on:
            found = self._runs_on[converted.model]
        elif len(self._runs_on) >= settings.BATCHERY_MAX_RECORD_MODEL_NAMES:
            # Each name costs a query: past the limit, one more is refused without its query.
            limit = settings.BATCHERY_MAX_RECORD_MODEL_NAMES
            raise RequestRefused(
                field,
                f"{converted.model[:100]!r} would be distinct model name {limit + 1} of this batch's requests, over "
                f"the limit of {limit} (BATCHERY_MAX_RECORD_MODEL_NAMES)",
            )
        else:
            found = self._runs_on[converted.model] = batch_model(self.tenant, converted.model)
        if found is None:
            raise RequestRefused(field, f"no enabled model or adapter named {converted.model!r}")
        model = found
        if self.model is not None:
            if model.pk != self.model.pk:
                raise RequestRefused(
                    field,
                    f"is {converted.model!r}, but requests.{self._model_index} runs on {self.model.name!r}; a batch "
                    "runs one model and its adapters, so every request must name that model or an adapter of it",
                )
            return model
        if model.task != CHAT_TASK:
            raise RequestRefused(
                field, f"model {model.name!r} serves task {model.task!r}; message batches need a 'chat' model"
            )
        self.model, self._model_index = model, index
        return model


def _submission_field(exc: SubmissionError, first_run: int) -> str:
    """The request field a refused submission names: the job's model and params are the first request's that
    runs."""
    if exc.field == "model":
        return f"requests.{first_run}.params.model"
    if exc.field == "params":
        return f"requests.{first_run}.params"
    return "requests"


def message_batch_create(
    *, tenant: Tenant, api_key: ApiKey, user: User | None, requests: Any, version: str
) -> MessageBatch:
    """Check every request, write them as the job's input and submit the job; the batch is visible to
    `api_key` only. `version` is the request's `anthropic-version`.

    A request whose params cannot run is kept as a refused record, which errors alone in the results; a batch
    none of whose requests runs has no job, and has ended at once. Raises `MessageBatchRefused` naming the
    request and field that malform the batch (or the job's submission refused), `QuotaExceeded` when a quota
    refuses the job; either way nothing is left behind.
    """
    if not isinstance(requests, list) or not requests:
        raise MessageBatchRefused("must be a non-empty list of {custom_id, params}", field="requests")
    if len(requests) > MAX_REQUESTS:
        raise MessageBatchRefused(
            f"holds {len(requests)} requests; a batch holds at most {MAX_REQUESTS}", field="requests"
        )
    now = timezone.now()
    batch = MessageBatch(
        id=f"msgbatch_{secrets.token_hex(12)}",
        tenant=tenant,
        api_key=api_key,
        created_by=user,
        created_at=now,
        expires_at=now + BATCH_LIFETIME,
    )
    job_input = message_batch_input(batch.id)
    store = store_for(job_input)
    writer = _BatchWriter(tenant, version)
    try:
        # Record by record into the store: the parsed body is the only copy of the batch held in memory.
        with store.open_write(job_input) as target:
            for index, request in enumerate(requests):
                target.write(writer.record(index, request))
        batch.request_count = writer.count
        with transaction.atomic():
            if writer.first_run is not None:
                assert writer.model is not None  # a request that runs named the batch's model
                batch.job = job_submit(
                    tenant=tenant,
                    user=user,
                    task=CHAT_TASK,
                    request=JobRequest(
                        model_name=writer.model.name,
                        model_version=writer.model.version,
                        input_uri=job_input,
                        params=writer.params,
                        deadline_seconds=BATCH_LIFETIME.total_seconds(),
                    ),
                )
            batch.save(force_insert=True)
    except BaseException as exc:
        store.delete_prefix(job_input)
        if isinstance(exc, SubmissionError) and not isinstance(exc, QuotaExceeded):
            assert writer.first_run is not None  # only a batch with a job is submitted
            raise MessageBatchRefused(exc.message, field=_submission_field(exc, writer.first_run)) from None
        raise
    return batch


def message_batch_cancel(*, batch: MessageBatch, actor: User | None = None) -> MessageBatch:
    """Cancel the batch's job; raises `CannotStop` once it has ended or is ending already."""
    if batch.job is None:
        raise MessageBatchRefused(f"{batch.id} has ended and has nothing to cancel", field="")
    job_cancel(job=batch.job, actor=actor)
    return MessageBatch.objects.select_related("job").get(pk=batch.pk)


def message_batch_delete(*, batch: MessageBatch) -> None:
    """Delete an ended batch, its job input and its job's output; the job row stays, with its usage.

    Raises `MessageBatchRefused` for a batch that has not ended, as Anthropic does. Storage goes once the
    row's deletion has committed (a failed delete leaves both).
    """
    status = processing_status(batch)
    if status != "ended":
        raise MessageBatchRefused(
            f"{batch.id} is {status}; only a batch that has ended can be deleted (cancel it first)", field=""
        )
    prefixes = [message_batch_prefix(batch.id)]
    job: Job | None = batch.job
    # The root is the folder of the job's output; checked, since deleting a wrong prefix loses others' data.
    if job is not None and job.output_uri and job_root(job).endswith(f"/{job.pk}"):
        prefixes.append(job_root(job))
    with transaction.atomic():
        batch.delete()
        transaction.on_commit(lambda: _delete_stored(prefixes))


def _delete_stored(prefixes: list[str]) -> None:
    for prefix in prefixes:
        try:
            store_for(prefix).delete_prefix(prefix)
        except Exception:
            logger.warning("message batch objects under %s not deleted", prefix, exc_info=True)
