"""Which LoRA adapter each record of a shard runs with, and what each adapter did.

A record names its adapter in its ``model`` field (a name the planner resolved into the shard's
``adapters``); a record naming none runs with the job's own adapter (``ShardSpec.adapter``), and one
naming the base model with none. The adapter's spec reaches the engine as the record's
`ADAPTER_PARAM`, which only this module sets: whatever a job's or a record's own params say under that
name is dropped, so that no request can run an adapter its tenant was not given.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from gpuworkers.batching import Item, RecordResult
from gpuworkers.engines.base import ADAPTER_PARAM
from tasks.shared.formats.records import REFUSED_FIELD
from tasks.shared.specs import ShardSpec

BASE_MODEL = ""
"""`ShardManifest.adapter_usage`'s key for the records that ran on the base model alone."""


def record_items(spec: ShardSpec, records: Iterable[Mapping[str, Any]]) -> tuple[list[Item], dict[str, str]]:
    """The shard's records as items, and each record's adapter key (``name@version``, `BASE_MODEL` for none) by
    custom_id when the job names adapters (empty otherwise). A refused record (`REFUSED_FIELD`) is an item that
    carries its refusal, which runs on nothing."""
    adapters = {name: adapter.to_dict() for name, adapter in spec.adapters.items()}
    default = spec.adapter or None
    items: list[Item] = []
    keys: dict[str, str] = {}
    for record in records:
        refused = record.get(REFUSED_FIELD)
        if refused is not None:
            # Nothing of it runs, on any adapter: its item carries only why.
            items.append(Item(record["custom_id"], None, refused=refused))
            continue
        own = record.get("params")
        if adapters:
            name = record.get("model", default)
            chosen = adapters.get(name) if isinstance(name, str) else None
            if chosen is None and name not in (None, spec.model.name):
                raise ValueError(f"record {record['custom_id']!r} names model {name!r}, not among its job's adapters")
            own = {**(own or {}), ADAPTER_PARAM: chosen}
            keys[record["custom_id"]] = BASE_MODEL if chosen is None else f"{chosen['name']}@{chosen['version']}"
        elif own and ADAPTER_PARAM in own:
            own = {key: value for key, value in own.items() if key != ADAPTER_PARAM}
        items.append(Item(record["custom_id"], record[spec.input_field], own))
    return items, keys


def named_models(results: Iterable[RecordResult], keys: Mapping[str, str]) -> Iterator[RecordResult]:
    """Pass results through, each response of a record that ran with an adapter naming it (``model``:
    ``name@version``), so that the APIs answer with the model each request ran on."""
    for result in results:
        key = keys.get(result.custom_id, BASE_MODEL) if keys else BASE_MODEL
        if key != BASE_MODEL and result.response is not None:
            result.response["model"] = key
        yield result


class AdapterTally:
    """Counts, per adapter, the records and tokens of the output lines that pass through `count`."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = keys
        self.usage: dict[str, list[int]] = {}
        """Adapter key -> [succeeded, failed, prompt tokens, completion tokens]."""

    def count(self, lines: Iterable[Any]) -> Iterator[Any]:
        """Pass `shard_execution.OutputLine`s through, counting each (its record is ``line.result``)."""
        for line in lines:
            if self._keys:
                totals = self.usage.setdefault(self._keys.get(line.result.custom_id, BASE_MODEL), [0, 0, 0, 0])
                totals[0 if line.error_code is None else 1] += 1
                totals[2] += line.prompt_tokens
                totals[3] += line.completion_tokens
            yield line
