"""Where a tenant's API callers may read job inputs from.

A tenant reads its own uploads, the prefixes every tenant may read (`BATCHERY_INPUT_ROOTS`) and its
own `storage_prefixes`. A `file://` URI is resolved first (`..` and symlinks followed), so it cannot
climb out of a root; an `s3://` URI is compared by the bucket and key the store will read
(`parse_s3_uri`, which refuses `.` and `..` segments), never by a reading of its own; URIs that would
make the server fetch from a host (`http://`, `https://`) are never accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.conf import settings

from portal.jobs.input_display import hide_storage_root
from portal.tenancy.models import Tenant
from portal.tenancy.stored_files import uploads_root
from tasks.shared.storage import StorageError
from tasks.shared.storage.s3 import parse_s3_uri

READABLE_SCHEMES = ("file", "s3")


def tenant_input_roots(tenant: Tenant) -> list[str]:
    return [*settings.BATCHERY_INPUT_ROOTS, *tenant.storage_prefixes, uploads_root(tenant.pk)]


def _canonical(uri: str) -> str:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).resolve().as_uri()
    return uri


def _s3_under(uri: str, root: str) -> bool:
    """True if the object the store reads for `uri` is `root` or below it, by bucket and key."""
    bucket, key = parse_s3_uri(uri)
    try:
        root_bucket, root_key = parse_s3_uri(root)
    except StorageError:
        return False  # an operator's malformed root admits nothing
    base = root_key.rstrip("/")
    return bucket == root_bucket and (not base or key == base or key.startswith(base + "/"))


def _file_under(uri: str, root: str) -> bool:
    canonical, base = _canonical(uri), _canonical(root).rstrip("/")
    return canonical == base or canonical.startswith(base + "/")


def input_refusal(uri: str, roots: Sequence[str]) -> str | None:
    """Why `uri` may not be read under `roots`, or None if it may."""
    scheme = urlparse(uri).scheme
    if scheme not in READABLE_SCHEMES:
        return (
            f"{scheme or 'scheme-less'} inputs are not accepted ({uri}): Batchery does not fetch from hosts; "
            f"give a {' or '.join(f'{scheme}://' for scheme in READABLE_SCHEMES)} URI"
        )
    if scheme == "s3":
        try:
            parse_s3_uri(uri)
        except StorageError as exc:
            return hide_storage_root(str(exc))
    under = _s3_under if scheme == "s3" else _file_under
    if any(urlparse(root).scheme == scheme and under(uri, root) for root in roots):
        return None
    # As a tenant sees them: its uploads as upload://, nothing of the platform's storage root.
    shown = ", ".join(root.rstrip("/") + "/" for root in roots) if roots else "none"
    return hide_storage_root(f"the input {uri} is outside the locations this tenant may read (allowed: {shown})")
