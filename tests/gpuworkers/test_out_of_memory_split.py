"""The micro-batch loop's out-of-memory handling: a batch that does not fit is split in halves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuworkers import batching
from gpuworkers.batching import OUT_OF_MEMORY, RecordResult, run_records
from tests.gpuworkers.echo_engines import EchoEngine, MemoryHungryEngine, items_of


def test_a_micro_batch_that_runs_out_of_memory_is_split_in_halves_until_it_fits() -> None:
    engine = MemoryHungryEngine(fits=2)

    results = list(run_records(engine, items_of(*"abcdefgh"), params={}, micro_batch_size=8))

    assert results == [RecordResult(f"id-{index}", {"echo": value}, None) for index, value in enumerate("abcdefgh")]
    assert engine.batches == [list(batch) for batch in ("abcdefgh", "abcd", "ab", "cd", "efgh", "ef", "gh")]


def test_a_record_that_runs_out_of_memory_alone_is_the_only_error_and_the_others_succeed_in_order() -> None:
    values = ["a", "b", "c", "d", "e", "huge", "g", "h"]
    engine = MemoryHungryEngine(fits=8)

    results = list(run_records(engine, items_of(*values), params={}, micro_batch_size=8))

    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(8)]
    assert results[5] == RecordResult(
        "id-5", None, {"code": OUT_OF_MEMORY, "message": "MemoryError: cannot fit 1 records"}
    )
    assert [result.response for index, result in enumerate(results) if index != 5] == [
        {"echo": value} for value in values if value != "huge"
    ]


def test_torch_out_of_memory_is_split_like_memory_error() -> None:
    import torch

    engine = MemoryHungryEngine(fits=1, exc_type=torch.OutOfMemoryError)

    results = list(run_records(engine, items_of("a", "huge"), params={}, micro_batch_size=2))

    assert results[0].response == {"echo": "a"}
    assert results[1].error == {"code": "out_of_memory", "message": "OutOfMemoryError: cannot fit 1 records"}


def test_each_out_of_memory_split_is_reported_with_the_size_of_the_batch_split() -> None:
    splits: list[int] = []

    list(
        run_records(
            MemoryHungryEngine(fits=2),
            items_of(*range(8)),
            params={},
            micro_batch_size=8,
            on_out_of_memory_split=splits.append,
        )
    )

    assert splits == [8, 4, 4]


def test_memory_is_freed_after_each_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    frees: list[int] = []
    engine = MemoryHungryEngine(fits=2)
    monkeypatch.setattr(batching, "free_device_memory", lambda: frees.append(len(engine.batches)))

    list(run_records(engine, items_of(*range(8)), params={}, micro_batch_size=8))

    # After the batch of 8 ran out of memory, and after each half of 4.
    assert frees == [1, 2, 5]


def test_the_failed_batch_is_garbage_before_its_halves_run() -> None:
    """The exception's traceback would keep the engine's frames, and the batch's tensors, alive."""
    import weakref

    class Activations:
        pass

    class HoldingEngine(EchoEngine):
        def __init__(self) -> None:
            super().__init__()
            self.previous: weakref.ref[Activations] | None = None
            self.alive_at_retry: list[bool] = []

        def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            if self.previous is not None:
                self.alive_at_retry.append(self.previous() is not None)
            activations = Activations()
            self.previous = weakref.ref(activations)
            if len(inputs) > 1:
                raise MemoryError("activations do not fit")
            return super().run_batch(inputs, params)

    engine = HoldingEngine()

    list(run_records(engine, items_of("a", "b"), params={}, micro_batch_size=2))

    assert engine.alive_at_retry == [False, False]


def test_a_batch_where_every_record_runs_out_of_memory_takes_at_most_two_n_minus_one_calls() -> None:
    engine = MemoryHungryEngine(fits=0)

    results = list(run_records(engine, items_of(*range(16)), params={}, micro_batch_size=16))

    assert [result.error["code"] for result in results if result.error] == [OUT_OF_MEMORY] * 16
    assert len(engine.batches) == 31
    assert sorted({len(batch) for batch in engine.batches}) == [1, 2, 4, 8, 16]


def test_a_half_that_fails_otherwise_is_run_record_by_record_with_engine_errors() -> None:
    engine = MemoryHungryEngine(fits=2, bad=frozenset({"b"}))

    results = list(run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=4))

    assert [result.error["code"] if result.error else None for result in results] == [None, "engine_error", None, None]
    assert engine.batches == [["a", "b", "c", "d"], ["a", "b"], ["a"], ["b"], ["c", "d"]]
