"""Where a tenant's stored files live in the platform's storage, and how many bytes they keep: its uploads
(`portal.jobs.services.uploads`) and its LoRA adapters (`portal.catalog.adapters`), which together count
towards its quota's `max_stored_bytes`."""

from __future__ import annotations

from django.conf import settings

from tasks.shared.storage import join_uri, store_for


def uploads_root(tenant_id: int) -> str:
    """Where a tenant's uploads live; the tenant's API callers may read inputs from here."""
    return join_uri(settings.BATCHERY_STORAGE_URL, "uploads", str(tenant_id))


def adapters_root(tenant_id: int) -> str:
    """Where a tenant's LoRA adapters live, a folder each."""
    return join_uri(settings.BATCHERY_STORAGE_URL, "adapters", str(tenant_id))


def stored_bytes(tenant_id: int) -> int:
    """Bytes of the tenant's uploads and adapters in the platform's storage now (from listings, so that every
    way a file leaves, deleted or expired, frees its room)."""
    return sum(store_for(root).prefix_bytes(root) for root in (uploads_root(tenant_id), adapters_root(tenant_id)))
