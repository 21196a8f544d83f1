"""A large `/v1/batches` input file is validated off the request: the batch reads `validating` with no job
until `batch_validate` (the control task's service) submits its job once, or fails it naming the lines."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from portal.catalog.models import Model
from portal.jobs.models import Job
from portal.jobs.services.stop import CannotStop
from portal.openai_api.models import Batch
from portal.openai_api.selectors import batch_object, batch_status
from portal.openai_api.services.batches import batch_cancel, batch_create
from portal.openai_api.services.files import file_upload
from portal.openai_api.services.sweep import batches_validation_resend
from portal.openai_api.services.validation import batch_validate, validation_lease_key, validation_task_id
from portal.tenancy.models import Quota, Tenant
from tasks.app import app
from tasks.control.validate_batch import validate_batch
from tasks.shared.config import VALIDATE_BATCH_TASK
from tasks.shared.leases import Lease
from tests.factories import ModelFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def validate_off_the_request(settings: Any) -> None:
    """Every file is over the threshold here: validated by the control task's service, not the request."""
    settings.BATCHERY_BATCH_SYNC_VALIDATION_BYTES = 1


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The validation messages sent, instead of sending them."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    send_task = app.send_task

    def record(name: str, args: tuple[Any, ...] = (), kwargs: Any = None, **options: Any) -> Any:
        if name != VALIDATE_BATCH_TASK:
            return send_task(name, args, kwargs, **options)
        calls.append((args, {"task_id": options["task_id"]}))
        return None

    monkeypatch.setattr(app, "send_task", record)
    return calls


def _request(n: int, model: str = "all-MiniLM-L6-v2", **body: Any) -> str:
    line = {"custom_id": f"r{n}", "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": f"t{n}"}}
    line["body"].update(body)
    return json.dumps(line)


def _create(tenant: Tenant, lines: list[str], endpoint: str = "/v1/embeddings") -> Batch:
    content = "".join(line + "\n" for line in lines).encode()
    upload = file_upload(tenant=tenant, filename="requests.jsonl", purpose="batch", chunks=iter([content]))
    return batch_create(tenant=tenant, user=None, input_file_id=upload.id, endpoint=endpoint, completion_window="24h")


def _fresh(batch: Batch) -> Batch:
    return Batch.objects.select_related("job__model").get(pk=batch.pk)


def test_a_file_over_the_threshold_gives_a_validating_batch_with_no_job_and_its_validation_sent_after_commit(
    acme: Tenant, minilm: Any, sent: list[Any], django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        batch = _create(acme, [_request(0), _request(1)])
    assert sent == [((batch.id,), {"task_id": validation_task_id(batch.id)})]
    shown = batch_object(_fresh(batch))
    assert shown["status"] == "validating" and shown["errors"] is None and shown["model"] is None
    assert shown["in_progress_at"] is None and shown["failed_at"] is None and shown["cancelled_at"] is None
    assert not Job.objects.exists()


def test_validating_submits_the_batchs_job_once_however_often_it_runs(acme: Tenant, minilm: Any, sent: Any) -> None:
    batch = _create(acme, [_request(0), _request(1)])

    assert batch_validate(batch_id=batch.id) is True
    assert batch_validate(batch_id=batch.id) is False

    job = Job.objects.get()
    assert _fresh(batch).job == job and job.total_records == 2
    assert batch_status(_fresh(batch)) == "validating"  # a queued job is still OpenAI's `validating`
    # The completion window counts from the batch's creation, validation included.
    assert job.deadline_at is not None
    assert abs((job.deadline_at - (batch.created_at + dt.timedelta(hours=24))).total_seconds()) < 60


def test_a_file_with_bad_lines_ends_failed_with_line_numbered_errors(acme: Tenant, minilm: Any, sent: Any) -> None:
    batch = _create(acme, [_request(0), "{broken", _request(2), _request(3, encoding_format="hex")])

    assert batch_validate(batch_id=batch.id) is True

    shown = batch_object(_fresh(batch))
    assert shown["status"] == "failed" and shown["failed_at"] is not None
    assert [error["line"] for error in shown["errors"]["data"]] == [2, 4]
    assert not Job.objects.exists()
    assert batch_validate(batch_id=batch.id) is False


def test_a_quota_refusal_ends_the_batch_failed_with_the_quotas_error(acme: Tenant, minilm: Any, sent: Any) -> None:
    Quota.objects.filter(tenant=acme).update(max_input_bytes=1)
    batch = _create(acme, [_request(0)])

    assert batch_validate(batch_id=batch.id) is True

    shown = batch_object(_fresh(batch))
    assert shown["status"] == "failed"
    [error] = shown["errors"]["data"]
    assert (error["code"], error["param"], error["line"]) == ("quota_exceeded", "max_input_bytes", None)
    assert "max_input_bytes" in error["message"]
    assert not Job.objects.exists()


def test_an_unknown_model_ends_the_batch_failed_naming_body_model(acme: Tenant, minilm: Any, sent: Any) -> None:
    batch = _create(acme, [_request(0, model="gpt-17")])

    assert batch_validate(batch_id=batch.id) is True

    [error] = batch_object(_fresh(batch))["errors"]["data"]
    assert error["param"] == "body.model" and "gpt-17" in error["message"]


def test_cancelling_a_validating_batch_ends_it_cancelled_and_its_validation_then_submits_nothing(
    acme: Tenant, minilm: Any, sent: Any
) -> None:
    batch = _create(acme, [_request(0)])

    cancelled = batch_cancel(batch=batch)

    shown = batch_object(cancelled)
    assert shown["status"] == "cancelled"
    assert shown["cancelling_at"] is not None and shown["cancelled_at"] is not None and shown["failed_at"] is None
    assert batch_validate(batch_id=batch.id) is False
    assert not Job.objects.exists()
    with pytest.raises(CannotStop):
        batch_cancel(batch=_fresh(batch))


def test_a_validation_held_by_another_run_is_left_to_it(acme: Tenant, minilm: Any, sent: Any) -> None:
    batch = _create(acme, [_request(0)])

    with Lease(validation_lease_key(batch.id), "another-worker", exclusive=True):
        assert batch_validate(batch_id=batch.id) is False

    assert batch_status(_fresh(batch)) == "validating" and not Job.objects.exists()


def test_a_validation_that_fails_for_good_ends_its_batch_failed(acme: Tenant, minilm: Any, sent: Any) -> None:
    batch = _create(acme, [_request(0)])

    validate_batch.on_failure(RuntimeError("disk on fire"), "task-1", (batch.id,), {}, None)

    shown = batch_object(_fresh(batch))
    assert shown["status"] == "failed" and "disk on fire" in shown["errors"]["data"][0]["message"]


@pytest.fixture
def old_batch(acme: Tenant, minilm: Any, sent: Any, settings: Any) -> Iterator[Batch]:
    settings.BATCHERY_BATCH_VALIDATION_RESEND_S = 600
    batch = _create(acme, [_request(0)])
    Batch.objects.filter(pk=batch.pk).update(created_at=timezone.now() - dt.timedelta(minutes=11))
    yield batch


def test_the_reconciler_sends_validation_again_for_a_batch_validating_too_long(
    old_batch: Batch, acme: Tenant, sent: list[Any]
) -> None:
    young = _create(acme, [_request(1)])
    assert batches_validation_resend(now=timezone.now()) == 1
    assert [(args, options["task_id"]) for args, options in sent] == [
        ((old_batch.id,), validation_task_id(old_batch.id))
    ]
    assert young.id not in [args[0] for args, _ in sent]


def test_the_reconciler_leaves_a_validation_that_a_worker_holds_or_that_ended(
    old_batch: Batch, sent: list[Any]
) -> None:
    with Lease(validation_lease_key(old_batch.id), "busy-worker", exclusive=True):
        assert batches_validation_resend(now=timezone.now()) == 0
    assert sent == []

    batch_validate(batch_id=old_batch.id)
    assert batches_validation_resend(now=timezone.now()) == 0
    assert sent == []


@pytest.mark.parametrize(("tool_parser", "line_errors"), [(None, [1]), ("hermes", [])])
def test_tool_choice_auto_is_taken_where_the_models_entry_names_a_tool_parser(
    acme: Tenant, sent: Any, tool_parser: str | None, line_errors: list[int]
) -> None:
    ModelFactory(
        name="chat-tools",
        engine=Model.Engine.VLLM,
        task=Model.Task.CHAT,
        source="/models/chat-tools",
        is_default=False,
        load_params={"tool_call_parser": tool_parser} if tool_parser else {},
    )
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    body = {"model": "chat-tools", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    line = {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions", "body": body}
    batch = _create(acme, [json.dumps(line)], endpoint="/v1/chat/completions")

    batch_validate(batch_id=batch.id)

    errors = (batch_object(_fresh(batch))["errors"] or {}).get("data", [])
    assert [error["line"] for error in errors] == line_errors
    assert all(error["param"] == "body.tool_choice" and "tool_call_parser" in error["message"] for error in errors)
