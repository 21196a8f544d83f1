"""Uploads through the API, streamed into storage (a body over the limit never gets here: see `body_limit`)."""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile

from portal.api.errors import submission_refused, too_large
from portal.jobs.quota import QuotaExceeded
from portal.jobs.services.uploads import UploadTooLarge, upload_store
from portal.tenancy.models import Tenant


def store_upload(tenant: Tenant, upload: UploadedFile) -> str:
    """Store an uploaded file under the tenant's uploads; its URI. 413 if over the limit."""
    limit = settings.BATCHERY_MAX_UPLOAD_BYTES
    if upload.size is not None and upload.size > limit:
        raise too_large(f"the file is {upload.size} bytes; uploads are limited to {limit} bytes")
    try:
        uri, _ = upload_store(tenant_id=tenant.pk, filename=upload.name or "input.jsonl", chunks=upload.chunks())
    except UploadTooLarge as exc:
        raise too_large(str(exc)) from None
    except QuotaExceeded as exc:
        raise submission_refused(exc) from None
    return uri
