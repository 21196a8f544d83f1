"""Writes that concern the catalog."""

from __future__ import annotations

from portal.catalog.models import Model
from tasks.shared.catalog import write_catalog


def catalog_publish() -> bool:
    """Publish every enabled model's spec to storage for GPU hosts; True if anything changed."""
    models = Model.objects.filter(enabled=True).select_related("gpu_class")
    return write_catalog([model.to_spec() for model in models])
