"""Write an OpenAI batch's output and error files once its job has ended (idempotent)."""

from __future__ import annotations

from tasks.app import app
from tasks.control.base import ControlTask
from tasks.shared.config import FINALIZE_BATCH_TASK


@app.task(name=FINALIZE_BATCH_TASK, base=ControlTask)
def finalize_batch(batch_id: str) -> bool:
    from portal.openai_api.services.batches import batch_finalize

    return batch_finalize(batch_id=batch_id)
