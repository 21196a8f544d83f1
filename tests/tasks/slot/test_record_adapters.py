"""Which adapter each record of a shard runs with: only the names the planner resolved into the shard's
message count; an `adapter` a job's or a record's own params give is dropped, whatever it says."""

from __future__ import annotations

from typing import Any

import pytest

from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.spec import AdapterSpec, ModelSpec
from tasks.shared.specs import ShardSpec
from tasks.slot.record_adapters import BASE_MODEL, AdapterTally, record_items
from tests.support.specs import message_spec

BASE = ModelSpec(name="base", version="1", engine="transformers", task="generate", source="/m")
ALPHA = AdapterSpec(name="alpha", version="2", source="/a", rank=4)
STOLEN = {"name": "secret", "version": "1", "source": "/other-tenant", "rank": 4}


def _spec(**fields: Any) -> ShardSpec:
    return message_spec(BASE, **fields)


def test_records_run_with_the_adapter_they_name_the_jobs_own_or_none_and_never_one_their_params_give() -> None:
    records = [
        {"custom_id": "a", "prompt": "p", "model": "alpha", "params": {ADAPTER_PARAM: STOLEN, "max_tokens": 3}},
        {"custom_id": "b", "prompt": "p", "params": {ADAPTER_PARAM: STOLEN}},
        {"custom_id": "c", "prompt": "p", "model": "base"},
    ]
    items, keys = record_items(_spec(adapters={"alpha": ALPHA}, adapter="alpha"), records)

    assert [item.params for item in items] == [
        {ADAPTER_PARAM: ALPHA.to_dict(), "max_tokens": 3},
        {ADAPTER_PARAM: ALPHA.to_dict()},
        {ADAPTER_PARAM: None},
    ]
    assert keys == {"a": "alpha@2", "b": "alpha@2", "c": BASE_MODEL}


def test_a_job_without_adapters_drops_an_adapter_its_records_params_give() -> None:
    records = [{"custom_id": "a", "prompt": "p", "params": {ADAPTER_PARAM: STOLEN, "max_tokens": 3}}]
    items, keys = record_items(_spec(), records)
    assert items[0].params == {"max_tokens": 3}
    assert keys == {}


def test_a_record_naming_an_adapter_its_shard_does_not_carry_is_refused() -> None:
    with pytest.raises(ValueError, match="names model 'secret', not among its job's adapters"):
        record_items(_spec(adapters={"alpha": ALPHA}), [{"custom_id": "a", "prompt": "p", "model": "secret"}])


def test_the_tally_counts_records_and_tokens_per_adapter() -> None:
    class Line:
        def __init__(self, custom_id: str, error: str | None, prompt: int, completion: int) -> None:
            self.result = type("R", (), {"custom_id": custom_id})()
            self.error_code, self.prompt_tokens, self.completion_tokens = error, prompt, completion

    tally = AdapterTally({"a": "alpha@2", "b": BASE_MODEL, "c": "alpha@2"})
    lines = [Line("a", None, 5, 2), Line("b", None, 4, 1), Line("c", "engine_error", 0, 0)]
    assert list(tally.count(lines)) == lines
    assert tally.usage == {"alpha@2": [1, 1, 5, 2], BASE_MODEL: [1, 0, 4, 1]}


def test_a_refused_record_is_an_item_carrying_its_refusal_on_no_adapter() -> None:
    records = [
        {"custom_id": "a", "prompt": "p", "model": "alpha"},
        {"custom_id": "b", "refused": "params.model: no enabled model or adapter named 'x'"},
    ]
    items, keys = record_items(_spec(adapters={"alpha": ALPHA}), records)

    assert items[1] == ("b", None, None, "params.model: no enabled model or adapter named 'x'")
    assert keys == {"a": "alpha@2"}
