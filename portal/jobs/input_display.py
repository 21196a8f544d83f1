"""A job's input as its tenant sees it: never the platform's storage root.

Uploads are stored under the platform's storage (BATCHERY_STORAGE_URL, `uploads/<tenant>/`), and an
OpenAI batch's converted input under `batches/<id>/`; the whole URI would show tenants the
platform's bucket and layout. Inputs the platform stored are shown relative to it (`upload://<name>`
for an upload, which a submission accepts back as its input, `batchery://<path>` for the rest); an
input the tenant named (their own `s3://` URI, a `file://` path under an input root) is shown as
given. Operators see the stored URI in the admin.
"""

from __future__ import annotations

from django.conf import settings

from portal.jobs.models import Job
from portal.jobs.services.uploads import UPLOAD_SCHEME, hide_storage_root, uploads_root

STORED_SCHEME = "batchery://"


def _under(uri: str, root: str) -> str | None:
    """The path of `uri` below `root`, or None when it is not below it (`root` ends at a path boundary)."""
    prefix = root.rstrip("/") + "/"
    return uri[len(prefix) :] if uri.startswith(prefix) else None


def shown_input_uri(uri: str, *, tenant_id: int) -> str:
    """`uri` as tenant `tenant_id` is shown it."""
    uploaded = _under(uri, uploads_root(tenant_id))
    if uploaded is not None:
        return UPLOAD_SCHEME + uploaded
    stored = _under(uri, settings.BATCHERY_STORAGE_URL)
    if stored is not None:
        return STORED_SCHEME + stored
    return uri


def tenant_input_uri(job: Job) -> str:
    """The job's input as its tenant's pages and API show it."""
    return shown_input_uri(job.input_uri, tenant_id=job.tenant_id)


def tenant_job_error(job: Job) -> str:
    """The job's error as its tenant sees it: a storage error's URIs without the platform's storage root."""
    return hide_storage_root(job.error)
