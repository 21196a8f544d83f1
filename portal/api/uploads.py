"""Uploads through the API: refused early when too large, then streamed into storage."""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from rest_framework.request import Request

from portal.api.errors import too_large
from portal.jobs.services.uploads import UploadTooLarge, upload_store
from portal.tenancy.models import Tenant

# Room for the multipart envelope and the other form fields around the file.
ENVELOPE_BYTES = 64 * 1024


def refuse_oversized_request(request: Request) -> None:
    """Answer 413 from the Content-Length alone, before reading a body that is too large."""
    declared = request.META.get("CONTENT_LENGTH") or "0"
    limit = settings.BATCHERY_MAX_UPLOAD_BYTES
    if declared.isdigit() and int(declared) > limit + ENVELOPE_BYTES:
        raise too_large(f"the request body is {declared} bytes; uploads are limited to {limit} bytes")


def store_upload(tenant: Tenant, upload: UploadedFile) -> str:
    """Store an uploaded file under the tenant's uploads; its URI. 413 if over the limit."""
    limit = settings.BATCHERY_MAX_UPLOAD_BYTES
    if upload.size is not None and upload.size > limit:
        raise too_large(f"the file is {upload.size} bytes; uploads are limited to {limit} bytes")
    try:
        uri, _ = upload_store(tenant_id=tenant.pk, filename=upload.name or "input.jsonl", chunks=upload.chunks())
    except UploadTooLarge as exc:
        raise too_large(str(exc)) from None
    return uri
