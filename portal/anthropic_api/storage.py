"""Where a message batch's own objects live in Batchery's storage."""

from __future__ import annotations

from django.conf import settings

from tasks.shared.storage import join_uri


def message_batch_prefix(batch_id: str) -> str:
    """The folder of a message batch's own objects: the job input written from its requests."""
    return join_uri(settings.BATCHERY_STORAGE_URL, "message_batches", batch_id)


def message_batch_input(batch_id: str) -> str:
    """The job input written from a message batch's requests."""
    return join_uri(message_batch_prefix(batch_id), "input.jsonl")
