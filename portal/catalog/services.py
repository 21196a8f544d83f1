"""Writes that concern the catalog."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import User

from portal.audit.services import audited_delete, audited_save
from portal.catalog.models import Adapter, Model, Price
from tasks.shared.catalog import write_catalog

MODEL_CHANGED = "model.changed"
ADAPTER_CHANGED = "adapter.changed"
PRICE_CHANGED = "price.changed"


def catalog_publish() -> bool:
    """Publish every enabled model's spec to storage for GPU hosts; True if anything changed."""
    models = Model.objects.filter(enabled=True).select_related("gpu_class")
    return write_catalog([model.to_spec() for model in models])


def model_save(*, model: Model, actor: User | None) -> None:
    """Save a catalog entry edited by hand (the admin), record the change and publish the catalog."""
    audited_save(obj=model, actor=actor, action=MODEL_CHANGED)
    catalog_publish()


def models_delete(*, models: Iterable[Model], actor: User | None) -> None:
    """Delete catalog entries by hand (the admin), each recorded, and publish the catalog."""
    audited_delete(objs=models, actor=actor, action=MODEL_CHANGED)
    catalog_publish()


def adapter_save(*, adapter: Adapter, actor: User | None) -> None:
    """Save an adapter edited by hand (the admin: shared adapters, enabling and disabling), recording the change."""
    audited_save(obj=adapter, actor=actor, action=ADAPTER_CHANGED)


def price_save(*, price: Price, actor: User | None) -> None:
    """Save a price set by hand (the admin), recording the change. Its validation (`Price.clean`, the
    currency, no negative amount) is the form's, before this is called."""
    audited_save(obj=price, actor=actor, action=PRICE_CHANGED)


def prices_delete(*, prices: Iterable[Price], actor: User | None) -> None:
    """Delete prices not yet in force, each recorded."""
    audited_delete(objs=prices, actor=actor, action=PRICE_CHANGED)
