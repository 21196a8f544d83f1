"""The micro-batch loop: per-record error isolation, order, progress and stopping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuworkers.batching import RecordResult, run_records


class EchoEngine:
    """Answers ``{"echo": value}`` per input and raises on any batch that holds a value in ``bad``."""

    def __init__(self, bad: frozenset[Any] = frozenset()) -> None:
        self.bad = bad
        self.batches: list[list[Any]] = []

    def load(self, *, device: str) -> None:
        pass

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.batches.append(list(inputs))
        for value in inputs:
            if value in self.bad:
                raise ValueError(f"cannot handle {value!r}")
        return [{"echo": value} for value in inputs]

    def memory_bytes(self) -> int:
        return 0

    def unload(self) -> None:
        pass


class RaisingEngine(EchoEngine):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        raise self.exc


def items_of(*values: Any) -> list[tuple[str, Any]]:
    return [(f"id-{index}", value) for index, value in enumerate(values)]


def test_a_record_that_raises_becomes_an_error_and_its_neighbours_succeed() -> None:
    engine = EchoEngine(bad=frozenset({"b"}))

    results = list(run_records(engine, items_of("a", "b", "c"), params={}, micro_batch_size=8))

    assert results == [
        RecordResult("id-0", {"echo": "a"}, None),
        RecordResult("id-1", None, {"code": "engine_error", "message": "ValueError: cannot handle 'b'"}),
        RecordResult("id-2", {"echo": "c"}, None),
    ]
    assert engine.batches == [["a", "b", "c"], ["a"], ["b"], ["c"]]


def test_only_the_failing_micro_batch_is_run_again_record_by_record() -> None:
    engine = EchoEngine(bad=frozenset({"d"}))

    list(run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=2))

    assert engine.batches == [["a", "b"], ["c", "d"], ["c"], ["d"]]


def test_results_come_in_input_order_across_micro_batches() -> None:
    values = [f"v{index}" for index in range(10)]
    engine = EchoEngine(bad=frozenset({"v3", "v7"}))

    results = list(run_records(engine, items_of(*values), params={}, micro_batch_size=3))

    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(10)]
    assert [result.error is not None for result in results] == [index in (3, 7) for index in range(10)]


def test_params_reach_the_engine() -> None:
    seen: list[Mapping[str, Any]] = []

    class ParamsEngine(EchoEngine):
        def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            seen.append(params)
            return super().run_batch(inputs, params)

    list(run_records(ParamsEngine(), items_of("a"), params={"normalize": True}, micro_batch_size=1))

    assert seen == [{"normalize": True}]


def test_progress_is_reported_after_each_micro_batch_with_running_totals() -> None:
    progress: list[tuple[int, int]] = []
    engine = EchoEngine(bad=frozenset({"c", "e"}))

    list(
        run_records(
            engine,
            items_of("a", "b", "c", "d", "e"),
            params={},
            micro_batch_size=2,
            on_progress=lambda done, errors: progress.append((done, errors)),
        )
    )

    assert progress == [(2, 0), (4, 1), (5, 2)]


def test_should_stop_ends_the_run_before_the_next_micro_batch() -> None:
    engine = EchoEngine()
    batches_run = 0

    def should_stop() -> bool:
        return batches_run >= 2

    def count(done: int, errors: int) -> None:
        nonlocal batches_run
        batches_run += 1

    results = list(
        run_records(
            engine,
            items_of(*range(10)),
            params={},
            micro_batch_size=3,
            on_progress=count,
            should_stop=should_stop,
        )
    )

    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(6)]
    assert len(engine.batches) == 2


def test_an_engine_that_returns_too_few_responses_fails_the_batch_and_every_record_alone() -> None:
    class ShortEngine(EchoEngine):
        def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            return super().run_batch(inputs, params)[:1] if len(inputs) > 1 else []

    results = list(run_records(ShortEngine(), items_of("a", "b"), params={}, micro_batch_size=2))

    assert [result.error for result in results] == [
        {"code": "engine_error", "message": "EngineOutputError: the engine returned 0 responses for 1 inputs"}
    ] * 2


def test_a_response_that_is_not_a_dict_is_an_error() -> None:
    class ListEngine(EchoEngine):
        def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            return [[value] for value in inputs]  # type: ignore[misc]

    (result,) = run_records(ListEngine(), items_of("a"), params={}, micro_batch_size=1)

    assert result.error == {
        "code": "engine_error",
        "message": "EngineOutputError: the engine returned a list, not a dict",
    }


def test_a_long_error_message_is_truncated() -> None:
    engine = RaisingEngine(ValueError("x" * 2000))

    (result,) = run_records(engine, items_of("a"), params={}, micro_batch_size=1)

    assert result.error is not None
    assert len(result.error["message"]) == 500
    assert result.error["message"].startswith("ValueError: xxx")


@pytest.mark.parametrize("exc", [MemoryError(), KeyboardInterrupt(), SystemExit(1)])
def test_running_out_of_memory_and_interrupts_propagate(exc: BaseException) -> None:
    with pytest.raises(type(exc)):
        list(run_records(RaisingEngine(exc), items_of("a", "b"), params={}, micro_batch_size=2))


def test_torch_out_of_memory_propagates() -> None:
    import torch

    with pytest.raises(torch.OutOfMemoryError):
        list(
            run_records(
                RaisingEngine(torch.OutOfMemoryError("CUDA out of memory")),
                items_of("a", "b"),
                params={},
                micro_batch_size=2,
            )
        )


def test_no_items_yield_nothing_and_report_no_progress() -> None:
    progress: list[tuple[int, int]] = []

    results = list(
        run_records(EchoEngine(), [], params={}, micro_batch_size=4, on_progress=lambda *args: progress.append(args))
    )

    assert results == []
    assert progress == []


def test_a_micro_batch_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        list(run_records(EchoEngine(), items_of("a"), params={}, micro_batch_size=0))
