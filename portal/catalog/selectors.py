"""Reads of the catalog: which models a tenant may use, and the model a request names."""

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


def newest_enabled_model(name: str, version: str | None = None) -> Model | None:
    """The model a request naming ``name`` (and ``version``) runs: the newest enabled one; None if there is none."""
    models = Model.objects.select_related("gpu_class").filter(name=name, enabled=True)
    if version:
        models = models.filter(version=version)
    return models.order_by("-created_at").first()


def tenant_model(tenant: Tenant, name: str, version: str | None = None) -> Model | None:
    """The model a request of `tenant` naming ``name`` (and ``version``) runs: the newest enabled one its quota
    allows; None if there is none. A model outside the quota is answered as one that does not exist, so a
    request cannot learn which models other tenants run, or their tasks."""
    models = models_for_tenant(tenant).filter(name=name)
    if version:
        models = models.filter(version=version)
    return models.order_by("-created_at").first()
