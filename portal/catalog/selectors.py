"""Reads of the catalog: which models a tenant may use."""

from __future__ import annotations

from django.db.models import QuerySet

from portal.catalog.models import Model
from portal.tenancy.models import Quota, Tenant


def models_for_tenant(tenant: Tenant) -> QuerySet[Model]:
    """Enabled models, narrowed by the tenant's quota to its allowed models and GPU classes."""
    models = Model.objects.select_related("gpu_class").filter(enabled=True)
    quota = Quota.objects.filter(tenant=tenant).first()
    if quota is None:
        return models
    allowed_models = list(quota.allowed_models.values_list("pk", flat=True))
    if allowed_models:
        models = models.filter(pk__in=allowed_models)
    allowed_classes = list(quota.allowed_gpu_classes.values_list("pk", flat=True))
    if allowed_classes:
        models = models.filter(gpu_class__in=allowed_classes)
    return models
