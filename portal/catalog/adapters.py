"""LoRA adapters in the catalog: registering a tenant's upload, and which adapters a tenant may use.

`adapter_register` checks an upload whole (`adapter_files`) before it stores anything: a refused upload
leaves no file and no row. It reads the small config first, then the weights' header, and stores the config
rebuilt from its checked fields; the weights are copied in chunks, and count, with the tenant's uploads,
towards its `max_stored_bytes`. The base model's weight shapes are read once per model version a process.
`adapter_lookup` answers what a job or a record means by a name: the tenant's own newest enabled version of
it, else a shared one, on a base model the tenant may use.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import OrderedDict
from typing import IO

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import F, Q, QuerySet

from gpuworkers.engines.base import EngineLoadError
from gpuworkers.engines.vllm_lora import DEFAULT_MAX_LORA_RANK
from gpuworkers.sources import resolve_model_source
from portal.catalog.adapter_files import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterRefused,
    adapter_check,
    base_model_shapes,
    read_config,
    safetensors_header,
)
from portal.catalog.models import Adapter, Model, Price
from portal.catalog.selectors import models_for_tenant, newest_enabled_model
from portal.catalog.services import prices_delete
from portal.jobs.models import FINAL_STATUSES, Job
from portal.jobs.quota import QuotaExceeded
from portal.tenancy.models import Quota, Tenant
from portal.tenancy.stored_files import adapters_root, stored_bytes
from tasks.shared.storage import StorageError, join_uri, store_for

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MAX_ADAPTERS_PER_TENANT = 200
"""Adapters one tenant may keep registered: each is a file in the shared storage and an entry every
record naming it is resolved against."""
BASE_SHAPES_CACHED = 8
"""Base model versions whose weight shapes a process keeps (a few hundred KB each for a large model)."""
_base_shapes_cache: OrderedDict[tuple[int, str], dict[str, list[int]]] = OrderedDict()
_base_shapes_lock = threading.Lock()


def adapters_for_tenant(tenant: Tenant) -> QuerySet[Adapter]:
    """The enabled adapters a tenant may use: its own and the shared ones, on base models it may use."""
    return Adapter.objects.select_related("base_model", "owner").filter(
        Q(owner=tenant) | Q(owner__isnull=True), enabled=True, base_model__in=models_for_tenant(tenant)
    )


def adapter_lookup(
    tenant: Tenant, name: str, *, base_model: Model | None = None, version: str | None = None
) -> Adapter | None:
    """The adapter ``name`` (and ``version``) means for this tenant (of ``base_model``, when given): its own
    newest version, else the newest shared one; None when it may use none of that name."""
    adapters = adapters_for_tenant(tenant).filter(name=name)
    if version:
        adapters = adapters.filter(version=version)
    if base_model is not None:
        adapters = adapters.filter(base_model=base_model)
    # The tenant's own adapter first (a shared one has no owner), then the newest.
    return adapters.order_by(F("owner").asc(nulls_last=True), "-created_at").first()


def adapter_register(
    *,
    tenant: Tenant,
    name: str,
    base_model_name: str,
    config: IO[bytes],
    config_bytes: int,
    weights: IO[bytes],
    weights_bytes: int,
    version: str = "1",
    description: str = "",
) -> Adapter:
    """Check an uploaded adapter against its base model and store it as the tenant's; raises `AdapterRefused`,
    or `QuotaExceeded` past the room the tenant's `max_stored_bytes` leaves.

    The checks run cheapest first, so that a refused upload costs little: the names, the sizes, the quota,
    the config (at most `MAX_CONFIG_BYTES` read), the weights' header, the base model's shapes (cached)."""
    if not NAME.match(name):
        raise AdapterRefused(
            f"name must be 1 to 100 letters, digits, '.', '_' or '-', starting with a letter or digit, not {name!r}",
            field="name",
        )
    if not NAME.match(version) or len(version) > 50:
        raise AdapterRefused(
            f"version must be 1 to 50 letters, digits, '.', '_' or '-', not {version!r}", field="version"
        )
    if Model.objects.filter(name=name).exists():
        raise AdapterRefused(f"{name!r} is a model's name; an adapter needs a name of its own", field="name")
    if Adapter.objects.filter(owner=tenant).count() >= MAX_ADAPTERS_PER_TENANT:
        raise AdapterRefused(
            f"the tenant already has {MAX_ADAPTERS_PER_TENANT} adapters, the most one may keep; delete one first",
            field="name",
        )
    base_model = _base_model(tenant, base_model_name)
    if config_bytes > MAX_CONFIG_BYTES:
        raise AdapterRefused(f"{CONFIG_FILE} is {config_bytes} bytes, over the limit of {MAX_CONFIG_BYTES}")
    if weights_bytes > settings.BATCHERY_MAX_ADAPTER_BYTES:
        raise AdapterRefused(
            f"{WEIGHTS_FILE} is {weights_bytes} bytes, over the limit of {settings.BATCHERY_MAX_ADAPTER_BYTES}"
        )
    _check_room(tenant, config_bytes + weights_bytes)
    max_rank = settings.BATCHERY_MAX_LORA_RANK
    if base_model.engine == Model.Engine.VLLM:
        max_rank = min(max_rank, int(base_model.load_params.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)))
    fields = read_config(config.read(MAX_CONFIG_BYTES + 1), max_rank=max_rank)
    header = safetensors_header(weights, name=WEIGHTS_FILE, size=weights_bytes)
    checked = adapter_check(
        fields,
        header,
        weights_bytes=weights_bytes,
        base_shapes=_base_shapes(base_model),
        max_bytes=settings.BATCHERY_MAX_ADAPTER_BYTES,
    )
    source = join_uri(adapters_root(tenant.pk), uuid.uuid4().hex)
    store = store_for(source)
    weights.seek(0)
    try:
        with store.open_write(join_uri(source, CONFIG_FILE)) as target:
            target.write(json.dumps(checked.config, indent=2, sort_keys=True).encode())
        with store.open_write(join_uri(source, WEIGHTS_FILE)) as target:
            while chunk := weights.read(1024 * 1024):
                target.write(chunk)
        with transaction.atomic():
            return Adapter.objects.create(
                name=name,
                version=version,
                description=description,
                base_model=base_model,
                owner=tenant,
                source=source,
                rank=checked.rank,
                size_bytes=checked.weights_bytes,
            )
    except IntegrityError:
        store.delete_prefix(source)
        raise AdapterRefused(
            f"the tenant already has version {version!r} of adapter {name!r}", field="version"
        ) from None
    except BaseException:
        store.delete_prefix(source)
        raise


def _check_room(tenant: Tenant, size: int) -> None:
    """Adapters are stored files of the tenant like its uploads: both count towards `max_stored_bytes`."""
    limit = Quota.objects.filter(tenant=tenant).values_list("max_stored_bytes", flat=True).first()
    if limit is None:
        return
    stored = stored_bytes(tenant.pk)
    if stored + size > limit:
        raise QuotaExceeded(
            quota="max_stored_bytes",
            limit=limit,
            current=stored,
            requested=size,
            message=f"quota max_stored_bytes exceeded: the tenant's uploads and adapters keep {stored} bytes, this "
            f"adapter needs {size}, the limit is {limit}; delete files or adapters, or ask an operator for more",
        )


class AdapterNotDeletable(Exception):
    """The tenant may not delete the adapter now: it is shared by the operators, or jobs that have not ended
    name it (deleting its files would fail their records)."""


def adapter_delete(adapter: Adapter, *, tenant: Tenant, actor: User | None) -> None:
    """Delete one of ``tenant``'s adapters and its files; jobs that ran it keep their outputs and ledger lines.

    The operators' prices for it go with it, each recorded in the audit log with the values it had (by
    ``actor``): a price names what it prices, and the tenant's data is the tenant's to delete. Past bills do
    not move, since every ledger line keeps the cost it was priced at when written (`JobUsage.cost`).

    Raises `AdapterNotDeletable` for a shared adapter, and while a job of the tenant that has not ended names it."""
    if adapter.owner_id != tenant.pk:
        raise AdapterNotDeletable(f"adapter {adapter.name!r} is shared by the operators; only they can delete it")
    using = (
        Job.objects.filter(tenant=adapter.owner, adapters__has_key=adapter.name)
        .exclude(status__in=FINAL_STATUSES)
        .count()
    )
    if using:
        raise AdapterNotDeletable(
            f"adapter {adapter.name!r} is named by {using} job(s) that have not ended; cancel them or wait for them"
        )
    source = adapter.source
    with transaction.atomic():
        prices_delete(prices=Price.objects.filter(adapter=adapter), actor=actor)
        adapter.delete()
    if source.startswith(settings.BATCHERY_STORAGE_URL):
        store_for(source).delete_prefix(source)


def adapter_base_problem(model: Model) -> str | None:
    """Why adapters cannot run on ``model``; None when it serves them."""
    if model.engine not in Adapter.ENGINES or model.task not in Adapter.TASKS:
        return (
            f"model {model.name!r} (engine {model.engine}, task {model.task}) does not serve adapters; "
            "adapters run on generate and chat models of the transformers and vllm engines"
        )
    if model.engine == Model.Engine.VLLM and not model.load_params.get("enable_lora"):
        return (
            f"model {model.name!r} is served by vLLM without LoRA; an operator enables it with the load param "
            "enable_lora"
        )
    return None


def adapter_base_models(tenant: Tenant) -> list[Model]:
    """The models a tenant may register adapters on, sorted by name: for each name it may use, the version
    `adapter_register` would check an upload against (the newest enabled one), where that one serves adapters."""
    allowed = models_for_tenant(tenant)
    found = []
    for name in sorted(set(allowed.values_list("name", flat=True))):
        model = newest_enabled_model(name)
        if model is not None and adapter_base_problem(model) is None and allowed.filter(pk=model.pk).exists():
            found.append(model)
    return found


def _base_model(tenant: Tenant, name: str) -> Model:
    model = newest_enabled_model(name)
    if model is None or not models_for_tenant(tenant).filter(pk=model.pk).exists():
        raise AdapterRefused(f"no enabled model named {name!r} that this tenant may use", field="base_model")
    problem = adapter_base_problem(model)
    if problem:
        raise AdapterRefused(problem, field="base_model")
    return model


def _base_shapes(model: Model) -> dict[str, list[int]]:
    """The base model's weight shapes, read from its headers once per model version (a catalog row, whose
    source does not change) and kept for the next upload, refused ones included."""
    key = (model.pk, model.source)
    with _base_shapes_lock:
        cached = _base_shapes_cache.get(key)
        if cached is not None:
            _base_shapes_cache.move_to_end(key)
            return cached
    shapes = _read_base_shapes(model)
    with _base_shapes_lock:
        _base_shapes_cache[key] = shapes
        while len(_base_shapes_cache) > BASE_SHAPES_CACHED:
            _base_shapes_cache.popitem(last=False)
    return shapes


def _read_base_shapes(model: Model) -> dict[str, list[int]]:
    try:
        if model.source.startswith("s3://"):
            store = store_for(model.source)
            names = [uri.removeprefix(model.source).lstrip("/") for uri in store.list_prefix(model.source)]
            return base_model_shapes(lambda name: store.open_read(join_uri(model.source, name)), names)
        directory = resolve_model_source(model.source)
        names = [path.name for path in directory.iterdir() if path.is_file()]
        return base_model_shapes(lambda name: (directory / name).open("rb"), names)
    except (EngineLoadError, StorageError, OSError) as exc:
        raise AdapterRefused(
            f"the base model's weights cannot be read to check the adapter against them: {exc}", field="base_model"
        ) from None
