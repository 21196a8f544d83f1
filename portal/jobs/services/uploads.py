"""Uploaded inputs: streamed into Batchery's storage under the tenant's own prefix.

An upload is copied in chunks, never held whole in memory, and refused with nothing left behind
past the size limit of one upload, or past the room its tenant's `max_stored_bytes` quota leaves
beside the uploads and LoRA adapters it already keeps (`portal.tenancy.stored_files`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable

from django.conf import settings

from portal.jobs.input_display import UPLOAD_SCHEME
from portal.jobs.quota import QuotaExceeded
from portal.tenancy.models import Quota
from portal.tenancy.stored_files import stored_bytes, uploads_root
from tasks.shared.storage import join_uri, store_for


class UploadTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the upload is larger than the limit of {limit} bytes")
        self.limit = limit


_UPLOAD_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def stored_upload_uri(uri: str, *, tenant_id: int) -> str:
    """`upload://<name>` (as a job shows its upload) as the stored URI of the tenant's own upload of that
    name; any other URI as it is. A name is one path segment: nothing reaches beyond the tenant's uploads."""
    if not uri.startswith(UPLOAD_SCHEME):
        return uri
    name = uri.removeprefix(UPLOAD_SCHEME)
    if not _UPLOAD_NAME.fullmatch(name):
        raise ValueError(f"{uri} does not name an upload: give upload://<name>, as a job of yours shows it")
    return join_uri(uploads_root(tenant_id), name)


def _safe_name(filename: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", filename.rsplit("/", 1)[-1]).strip("._")
    return name[:100] or "input.jsonl"


def _stored_over_quota(limit: int, stored: int, size: int) -> QuotaExceeded:
    return QuotaExceeded(
        quota="max_stored_bytes",
        limit=limit,
        current=stored,
        requested=size,
        message=f"quota max_stored_bytes exceeded: the tenant's uploads and adapters keep {stored} bytes, this "
        f"upload needs {size} or more, the limit is {limit}; delete files or ask an operator for more",
    )


def upload_store(
    *, tenant_id: int, filename: str, chunks: Iterable[bytes], limit: int | None = None
) -> tuple[str, int]:
    """Store an upload; return its URI and size. Raises `UploadTooLarge` past `limit`, `QuotaExceeded`
    past the tenant's room for stored uploads, and keeps nothing when it raises."""
    limit = settings.BATCHERY_MAX_UPLOAD_BYTES if limit is None else limit
    quota = Quota.objects.filter(tenant_id=tenant_id).values_list("max_stored_bytes", flat=True).first()
    stored = stored_bytes(tenant_id) if quota is not None else 0
    room = None if quota is None else quota - stored
    uri = join_uri(uploads_root(tenant_id), f"{uuid.uuid4().hex}-{_safe_name(filename)}")
    size = 0
    with store_for(uri).open_write(uri) as target:
        for chunk in chunks:
            size += len(chunk)
            # Raising inside the writer discards what was written.
            if size > limit:
                raise UploadTooLarge(limit)
            if room is not None and size > room:
                raise _stored_over_quota(quota or 0, stored, size)
            target.write(chunk)
    return uri, size
