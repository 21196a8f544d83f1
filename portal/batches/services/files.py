"""`/v1/files`: uploads kept in Batchery's storage, one row each."""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from django.db import transaction

from portal.batches.models import File
from portal.jobs.services.uploads import upload_store
from portal.tenancy.models import Tenant
from tasks.storage import store_for


class FileRefused(Exception):
    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_upload(*, tenant: Tenant, filename: str, purpose: str, chunks: Iterable[bytes]) -> File:
    """Store an upload for a batch; raises `FileRefused` for a purpose other than `batch`."""
    if purpose != File.Purpose.BATCH:
        raise FileRefused(f"purpose must be 'batch' (got {purpose!r}); Batchery serves batches only", param="purpose")
    uri, size = upload_store(tenant_id=tenant.pk, filename=filename, chunks=chunks)
    return File.objects.create(
        id=new_file_id(), tenant=tenant, purpose=File.Purpose.BATCH, filename=filename, bytes=size, uri=uri
    )


def file_delete(*, file: File) -> None:
    """Delete the row, then the object once that has committed (a failed delete leaves both)."""
    uri = file.uri
    with transaction.atomic():
        file.delete()
        transaction.on_commit(lambda: store_for(uri).delete_prefix(uri))
