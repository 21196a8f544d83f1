"""The catalog as GPU hosts see it: a file of model specs in storage, published by the control side.

GPU hosts have no database; a slot that preloads models (`launch --preload NAME`) reads their
specs here.
"""

from __future__ import annotations

import orjson

from gpuworkers.spec import ModelSpec
from tasks.shared.config import storage_url
from tasks.shared.storage import StorageError, join_uri, store_for


def catalog_uri() -> str:
    return join_uri(storage_url(), "catalog", "models.json")


def write_catalog(specs: list[ModelSpec]) -> bool:
    """Write the specs if they changed; True if the file was written."""
    uri = catalog_uri()
    store = store_for(uri)
    data = orjson.dumps(sorted((spec.to_dict() for spec in specs), key=lambda s: (s["name"], s["version"])))
    try:
        if store.read_bytes(uri) == data:
            return False
    except StorageError:
        pass
    with store.open_write(uri) as handle:
        handle.write(data)
    return True


def find_spec(reference: str) -> ModelSpec:
    """`name` (the newest version) or `name@version`, from the published catalog."""
    name, _, version = reference.partition("@")
    try:
        specs = [ModelSpec.from_dict(item) for item in orjson.loads(store_for(catalog_uri()).read_bytes(catalog_uri()))]
    except StorageError as exc:
        raise LookupError(f"no published catalog at {catalog_uri()}: {exc}") from None
    matches = [spec for spec in specs if spec.name == name and (not version or spec.version == version)]
    if not matches:
        raise LookupError(f"model {reference!r} is not in the published catalog")
    return max(matches, key=lambda spec: spec.version)
