"""The LoRA adapters a job runs: the one it names in place of its model, and those its records name.

A record may name, in its ``model`` field, its job's model or an adapter of that model that the job's
tenant may use (`portal.catalog.adapters.adapter_lookup`); a record naming none runs as its job says.
`JobAdapters` judges each record's name as the input is read (at submission for a small input, by the
planner for every input) and keeps what each name resolved to: the job's `adapters`, which every shard's
message carries, so that a slot never looks anything up.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import F

from portal.catalog.adapters import adapter_lookup, adapters_for_tenant
from portal.catalog.models import Adapter, Model
from portal.catalog.selectors import tenant_model
from portal.tenancy.models import Tenant
from tasks.shared.formats.records import Record


def model_runs_on(tenant: Tenant, name: str) -> Model | None:
    """The catalog model a request naming ``name`` runs on: the newest enabled model of that name the tenant's
    quota allows, else the base model of the tenant's (or a shared) adapter of that name; None when the tenant
    may use neither (a model outside its quota answers as one that does not exist)."""
    model = tenant_model(tenant, name)
    if model is not None:
        return model
    adapter = adapter_lookup(tenant, name)
    return None if adapter is None else adapter.base_model


def adapter_entry(adapter: Adapter, *, default: bool = False) -> dict[str, Any]:
    """How `Job.adapters` keeps one adapter: its id (for the ledger) and its spec (for the slots)."""
    entry: dict[str, Any] = {"id": adapter.pk, "spec": adapter.to_spec().to_dict()}
    if default:
        entry["default"] = True
    return entry


class JobAdapters:
    """Resolves the model names a job's records give, keeping what each resolved to (`entries`)."""

    def __init__(self, tenant: Tenant, model: Model, entries: dict[str, Any] | None = None) -> None:
        self.tenant = tenant
        self.model = model
        self.entries: dict[str, Any] = dict(entries or {})
        """Name -> `adapter_entry`: those the job had, and those its records named since."""
        self.added = False
        """Set when a record named an adapter that `entries` did not hold yet; the caller clears it."""
        self._refused: set[str] = set()
        self._usable: dict[str, Adapter] | None = None
        """Name -> the adapter of the job's model it means for the tenant, loaded once at the first name that
        needs it: a record's unknown name costs no query (a tenant keeps a few hundred adapters at most)."""

    def record_problem(self, record: Record) -> str | None:
        """What is wrong with the model a record names; None when it names none, the job's, or an adapter of it."""
        name = record.data.get("model")
        if name is None or name == self.model.name or (isinstance(name, str) and name in self.entries):
            return None
        if not isinstance(name, str) or not name:
            return "model must be a non-empty string: the job's model or the name of an adapter of it"
        if name in self._refused:
            return self._unknown(name)
        limit = settings.BATCHERY_MAX_RECORD_MODEL_NAMES
        if len(self.entries) + len(self._refused) >= limit:
            # Not remembered: past the limit a name costs neither a query nor memory.
            return (
                f"model {name[:100]!r} would be distinct model name {limit + 1} of this job's records, over the "
                f"limit of {limit} (BATCHERY_MAX_RECORD_MODEL_NAMES)"
            )
        adapter = self._adapters().get(name)
        if adapter is None:
            self._refused.add(name)
            return self._unknown(name)
        most = settings.BATCHERY_MAX_ADAPTERS_PER_JOB
        if len(self.entries) >= most:
            return f"model {name!r} would be adapter {most + 1} of this job, over the limit of {most} a job"
        self.entries[name] = adapter_entry(adapter)
        self.added = True
        return None

    def _unknown(self, name: str) -> str:
        return (
            f"model {name[:100]!r} is neither the job's model {self.model.name!r} nor an adapter of it that this "
            "tenant may use"
        )

    def _adapters(self) -> dict[str, Adapter]:
        if self._usable is None:
            found = adapters_for_tenant(self.tenant).filter(base_model=self.model)
            # As `adapter_lookup` chooses: the tenant's own first (a shared one has no owner), then the newest.
            ordered = found.order_by(F("owner").asc(nulls_last=True), "-created_at")
            self._usable = {}
            for adapter in ordered:
                self._usable.setdefault(adapter.name, adapter)
        return self._usable
