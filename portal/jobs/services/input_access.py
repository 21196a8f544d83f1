"""Where a tenant's API callers may read job inputs from.

A tenant reads its own uploads, the prefixes every tenant may read (`BATCHERY_INPUT_ROOTS`) and its
own `storage_prefixes`. A `file://` URI is resolved first (`..` and symlinks followed), so it cannot
climb out of a root; URIs that would make the server fetch from a host (`http://`, `https://`) are
never accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from django.conf import settings

from portal.jobs.services.uploads import hide_storage_root, uploads_root
from portal.tenancy.models import Tenant

READABLE_SCHEMES = ("file", "s3")


def tenant_input_roots(tenant: Tenant) -> list[str]:
    return [*settings.BATCHERY_INPUT_ROOTS, *tenant.storage_prefixes, uploads_root(tenant.pk)]


def _canonical(uri: str) -> str:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).resolve().as_uri()
    return uri


def input_refusal(uri: str, roots: Sequence[str]) -> str | None:
    """Why `uri` may not be read under `roots`, or None if it may."""
    parsed = urlparse(uri)
    if parsed.scheme not in READABLE_SCHEMES:
        return (
            f"{parsed.scheme or 'scheme-less'} inputs are not accepted ({uri}): Batchery does not fetch from hosts; "
            f"give a {' or '.join(f'{scheme}://' for scheme in READABLE_SCHEMES)} URI"
        )
    if parsed.scheme != "file" and ".." in PurePosixPath(parsed.path).parts:
        return f"the input {uri} contains '..'"
    canonical = _canonical(uri)
    for root in roots:
        base = _canonical(root).rstrip("/")
        if canonical == base or canonical.startswith(base + "/"):
            return None
    # As a tenant sees them: its uploads as upload://, nothing of the platform's storage root.
    shown = ", ".join(root.rstrip("/") + "/" for root in roots) if roots else "none"
    return hide_storage_root(f"the input {uri} is outside the locations this tenant may read (allowed: {shown})")
