"""`/v1/files`: uploads kept in Batchery's storage, one row each."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import transaction
from django.utils import timezone

from portal.jobs.services.uploads import upload_store
from portal.openai_api.models import File
from portal.openai_api.services.expiry import ExpiryRefused, expires_at, expiry_seconds
from portal.tenancy.models import Tenant
from tasks.shared.storage import store_for


class FileRefused(Exception):
    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_upload(
    *,
    tenant: Tenant,
    filename: str,
    purpose: str,
    chunks: Iterable[bytes],
    expires_after: Mapping[str, Any] | None = None,
) -> File:
    """Store an upload for a batch, to expire as `expires_after` (OpenAI's policy) says; raises
    `FileRefused` for a purpose other than `batch` or a policy OpenAI would refuse."""
    if purpose != File.Purpose.BATCH:
        raise FileRefused(f"purpose must be 'batch' (got {purpose!r}); Batchery serves batches only", param="purpose")
    try:
        seconds = expiry_seconds(expires_after, field="expires_after")
    except ExpiryRefused as exc:
        raise FileRefused(str(exc), param=exc.param) from None
    uri, size = upload_store(tenant_id=tenant.pk, filename=filename, chunks=chunks)
    now = timezone.now()
    return File.objects.create(
        id=new_file_id(),
        tenant=tenant,
        purpose=File.Purpose.BATCH,
        filename=filename,
        bytes=size,
        uri=uri,
        created_at=now,
        expires_at=expires_at(now, seconds),
    )


def file_delete(*, file: File) -> None:
    """Delete the row, then the object once that has committed (a failed delete leaves both)."""
    uri = file.uri
    with transaction.atomic():
        file.delete()
        transaction.on_commit(lambda: store_for(uri).delete_prefix(uri))
