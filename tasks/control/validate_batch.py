"""Validate a large `/v1/batches` input file off the request (the `validation` queue, its own worker, so
that a tenant's many large files never wait in front of the control lane): the batch reads
`validating` until this submits its job or fails it (`portal.openai_api.services.validation`)."""

from __future__ import annotations

from typing import Any

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import VALIDATE_BATCH_TASK
from tasks.shared.storage import TransientStorageError


class ValidateBatchTask(ControlTask):
    """A validation that fails for good ends its batch `failed`, so that no batch stays `validating`."""

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        super().on_failure(exc, task_id, args, kwargs, einfo)  # logs it; fails no job (it takes a batch id)
        from portal.openai_api.services.validation import batch_validation_fail

        batch_id = kwargs.get("batch_id") or (args[0] if args else None)
        if batch_id is None:
            return
        error = {
            "code": "validation_failed",
            "message": f"the input file could not be validated: {type(exc).__name__}: {exc}",
            "param": "input_file_id",
            "line": None,
        }
        batch_validation_fail(batch_id=str(batch_id), errors={"object": "list", "data": [error]})


@app.task(name=VALIDATE_BATCH_TASK, base=ValidateBatchTask, bind=True)
def validate_batch(self: Any, batch_id: str) -> bool:
    from portal.openai_api.services.validation import batch_validate

    try:
        return batch_validate(batch_id=batch_id, worker=f"{self.request.hostname}:{self.request.id}")
    except TransientStorageError as exc:
        # A storage hiccup passes: read the file again later rather than fail the batch.
        raise self.retry(exc=exc, countdown=min(60, 2**self.request.retries)) from exc
