from __future__ import annotations

from pathlib import Path

import orjson

from gpuworkers.batching import Item
from gpuworkers.engines import create_engine
from gpuworkers.spec import ModelSpec
from tasks.shared.storage.local import LocalStore
from tasks.slot.record_adapters import BASE_MODEL
from tasks.slot.shard_bisect import plan_ranges, run_checkpointed

ECHO = "tests.support.chaos_engines"


def test_with_nothing_finished_the_shard_is_cut_into_chunks() -> None:
    assert plan_ranges(10, [], None, 4) == ([(0, 4), (4, 8), (8, 10)], None)


def test_finished_ranges_are_kept_and_the_range_that_killed_the_worker_is_halved() -> None:
    work, poison = plan_ranges(12, [(0, 4)], (4, 8), 4)
    assert work == [(4, 6), (6, 8), (8, 12)]
    assert poison is None


def test_a_single_record_that_killed_the_worker_again_is_given_up_as_poison() -> None:
    work, poison = plan_ranges(8, [(0, 4), (4, 6)], (6, 7), 4)
    assert poison == (6, 7)
    assert work == [(7, 8)]


def test_the_gap_before_a_crashed_range_is_still_run() -> None:
    work, poison = plan_ranges(16, [(0, 2)], (8, 12), 4)
    assert work == [(2, 6), (6, 8), (8, 10), (10, 12), (12, 16)]
    assert poison is None


def test_a_checkpointed_run_names_the_adapter_each_record_ran_with_as_the_plain_run_does(tmp_path: Path) -> None:
    engine = create_engine(
        ModelSpec(name="echo", version="1", engine="python", task="classify", source=f"{ECHO}:echo_factory")
    )
    engine.load(device="cpu")
    items = [Item("a", "first", None), Item("b", "second", None)]

    lines = run_checkpointed(
        store=LocalStore(),
        prefix=(tmp_path / "bisect").as_uri(),
        engine=engine,
        items=items,
        params={},
        chunk=1,
        attempt_no=4,
        give_up_in_flight=False,
        should_stop=lambda: False,
        adapter_keys={"a": "alpha@2", "b": BASE_MODEL},
    )

    assert lines is not None
    responses = {line["custom_id"]: line["response"] for line in map(orjson.loads, lines)}
    assert responses["a"]["model"] == "alpha@2"
    assert "model" not in responses["b"], "the base model's records name nothing more"
