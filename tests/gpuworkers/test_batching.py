"""The micro-batch loop: per-record error isolation, order, progress and stopping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuworkers import batching
from gpuworkers.batching import Item, RecordResult, run_records
from gpuworkers.faults import StickyDeviceError
from tests.gpuworkers.echo_engines import EchoEngine, MemoryHungryEngine, items_of


class RaisingEngine(EchoEngine):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        raise self.exc


class StickyEngine(EchoEngine):
    """Echoes, but any batch that holds ``"sticky"`` meets a CUDA error that breaks the context."""

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        if "sticky" in inputs:
            self.batches.append(list(inputs))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().run_batch(inputs, params)


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


class ParamsEchoEngine(EchoEngine):
    """Echoes each input with the params of the call that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[Any], dict[str, Any]]] = []

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.calls.append((list(inputs), dict(params)))
        return [{"echo": value, "params": dict(params)} for value in inputs]


def test_records_with_their_own_params_run_in_one_call_per_set_of_params_in_input_order() -> None:
    engine = ParamsEchoEngine()
    items = [
        Item("1", "a"),
        Item("2", "b", {"max_tokens": 9}),
        Item("3", "c"),
        Item("4", "d", {"max_tokens": 9}),
        Item("5", "e", {"temperature": None}),  # a null falls back to the engine's default
    ]

    results = list(run_records(engine, items, params={"max_tokens": 4, "temperature": 0.5}, micro_batch_size=8))

    assert [(result.custom_id, result.response) for result in results] == [
        ("1", {"echo": "a", "params": {"max_tokens": 4, "temperature": 0.5}}),
        ("2", {"echo": "b", "params": {"max_tokens": 9, "temperature": 0.5}}),
        ("3", {"echo": "c", "params": {"max_tokens": 4, "temperature": 0.5}}),
        ("4", {"echo": "d", "params": {"max_tokens": 9, "temperature": 0.5}}),
        ("5", {"echo": "e", "params": {"max_tokens": 4}}),
    ]
    assert sorted(inputs for inputs, _ in engine.calls) == [["a", "c"], ["b", "d"], ["e"]]


def test_an_engine_that_takes_params_per_input_gets_the_micro_batch_in_one_call() -> None:
    class PerRequestEngine(ParamsEchoEngine):
        def run_requests(self, inputs: Sequence[Any], params: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
            self.calls.append((list(inputs), {"each": [dict(own) for own in params]}))
            return [{"echo": value} for value in inputs]

    engine = PerRequestEngine()

    list(run_records(engine, [Item("1", "a"), Item("2", "b", {"n": 2})], params={"n": 1}, micro_batch_size=8))

    assert engine.calls == [(["a", "b"], {"each": [{"n": 1}, {"n": 2}]})]


def test_a_micro_batch_without_own_params_is_one_plain_call() -> None:
    engine = ParamsEchoEngine()

    list(run_records(engine, [Item("1", "a"), Item("2", "b", {})], params={"n": 1}, micro_batch_size=8))

    assert engine.calls == [(["a", "b"], {"n": 1})]


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


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1)])
def test_interrupts_propagate(exc: BaseException) -> None:
    with pytest.raises(type(exc)):
        list(run_records(RaisingEngine(exc), items_of("a", "b"), params={}, micro_batch_size=2))


class Interrupted(Exception):
    """Stands for Celery's SoftTimeLimitExceeded, an Exception that must not become a record's error."""


def _wrapped_interrupt() -> Exception:
    try:
        raise Interrupted()
    except Interrupted as interrupt:
        wrapped = RuntimeError("the engine failed")
        wrapped.__cause__ = interrupt
        return wrapped


@pytest.mark.parametrize("exc", [Interrupted(), _wrapped_interrupt()], ids=["bare", "wrapped by the engine"])
def test_exceptions_of_the_propagate_kinds_pass_through_even_wrapped(exc: Exception) -> None:
    with pytest.raises(type(exc)):
        list(
            run_records(RaisingEngine(exc), items_of("a", "b"), params={}, micro_batch_size=2, propagate=(Interrupted,))
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


def test_a_sticky_device_error_raises_at_once_chained_to_the_original_and_is_not_isolated() -> None:
    engine = StickyEngine()

    with pytest.raises(StickyDeviceError, match="illegal memory access") as caught:
        list(run_records(engine, items_of("a", "sticky", "c"), params={}, micro_batch_size=8))

    assert isinstance(caught.value.__cause__, RuntimeError)
    assert engine.batches == [["a", "sticky", "c"]]


def test_results_before_a_sticky_device_error_are_yielded_and_the_rest_are_not_run() -> None:
    engine = StickyEngine()
    results: list[RecordResult] = []

    with pytest.raises(StickyDeviceError):
        for result in run_records(engine, items_of("a", "b", "sticky", "d", "e"), params={}, micro_batch_size=2):
            results.append(result)

    assert [result.response for result in results] == [{"echo": "a"}, {"echo": "b"}]
    assert engine.batches == [["a", "b"], ["sticky", "d"]]


def test_a_sticky_device_error_met_while_isolating_records_still_raises() -> None:
    class BadThenSticky(StickyEngine):
        def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            if len(inputs) > 1:
                raise ValueError("a bad record somewhere")
            return super().run_batch(inputs, params)

    with pytest.raises(StickyDeviceError):
        list(run_records(BadThenSticky(), items_of("a", "sticky", "c"), params={}, micro_batch_size=8))


def test_a_sticky_device_error_during_out_of_memory_splitting_still_raises() -> None:
    class HungryThenSticky(MemoryHungryEngine):
        def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
            if len(inputs) <= self.fits and "sticky" in inputs:
                raise RuntimeError("CUDA error: device-side assert triggered")
            return super().run_batch(inputs, params)

    with pytest.raises(StickyDeviceError, match="device-side assert"):
        list(run_records(HungryThenSticky(fits=2), items_of("a", "b", "c", "sticky"), params={}, micro_batch_size=4))


class LengthLimitedEngine(EchoEngine):
    """Echoes texts of at most ``limit`` characters; a longer one is too long unless truncated."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.measured: list[list[Any]] = []

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        self.measured.append(list(inputs))
        return [f"{len(text)} characters, over {self.limit}" if len(text) > self.limit else None for text in inputs]


def test_a_record_over_the_models_limit_gets_input_too_long_and_the_others_run_in_one_call() -> None:
    engine = LengthLimitedEngine(limit=5)
    items = [Item("a", "short"), Item("b", "far too long"), Item("c", "tiny")]

    results = list(run_records(engine, items, params={}, micro_batch_size=8))

    assert [result.custom_id for result in results] == ["a", "b", "c"]
    assert results[1] == RecordResult("b", None, {"code": batching.INPUT_TOO_LONG, "message": "12 characters, over 5"})
    assert [result.response for result in (results[0], results[2])] == [{"echo": "short"}, {"echo": "tiny"}]
    # Measured once, then one engine call for the records that fit: no bisection over the long one.
    assert engine.measured == [["short", "far too long", "tiny"]]
    assert engine.batches == [["short", "tiny"]]


def test_truncate_in_the_job_or_a_records_params_lets_a_long_record_run() -> None:
    engine = LengthLimitedEngine(limit=5)
    items = [Item("a", "far too long", {"truncate": True}), Item("b", "also too long")]

    own = list(run_records(engine, items, params={}, micro_batch_size=8))
    whole_job = list(run_records(engine, [Item("c", "long for sure")], params={"truncate": True}, micro_batch_size=8))

    assert own[0].response == {"echo": "far too long"} and own[1].error is not None
    assert own[1].error["code"] == batching.INPUT_TOO_LONG
    assert whole_job[0].response == {"echo": "long for sure"}


def test_a_micro_batch_of_only_long_records_calls_the_engine_not_at_all() -> None:
    engine = LengthLimitedEngine(limit=1)

    results = list(run_records(engine, [Item("a", "xx"), Item("b", "yy")], params={}, micro_batch_size=8))

    assert [result.error["code"] for result in results if result.error] == [batching.INPUT_TOO_LONG] * 2
    assert engine.batches == []


def test_should_stop_is_not_asked_before_the_first_micro_batch() -> None:
    """The caller has just decided to start; it is asked again only between micro-batches."""
    engine = EchoEngine()
    asked = 0

    def should_stop() -> bool:
        nonlocal asked
        asked += 1
        return True

    results = list(run_records(engine, items_of(*range(5)), params={}, micro_batch_size=3, should_stop=should_stop))

    assert [result.custom_id for result in results] == [f"id-{index}" for index in range(3)]
    assert asked == 1


def test_a_record_s_error_names_no_location_of_the_host_or_its_storage() -> None:
    engine = RaisingEngine(
        FileNotFoundError(
            "no tokenizer at /var/lib/batchery/model-cache/ab12/tokenizer.json nor at "
            "s3://platform-bucket/adapters/17/alpha/ (tried 'config.json')"
        )
    )

    [result] = run_records(engine, items_of("a"), params={}, micro_batch_size=8)

    assert result.error == {
        "code": "engine_error",
        "message": "FileNotFoundError: no tokenizer at <path> nor at <path> (tried 'config.json')",
    }


def test_a_refused_record_gets_invalid_request_without_being_measured_or_run_and_the_others_run() -> None:
    engine = LengthLimitedEngine(limit=5)
    items = [Item("a", "short"), Item("b", None, refused="params.max_tokens: must be at least 1"), Item("c", "tiny")]

    results = list(run_records(engine, items, params={}, micro_batch_size=8))

    assert [result.custom_id for result in results] == ["a", "b", "c"]
    assert results[1] == RecordResult(
        "b", None, {"code": batching.INVALID_REQUEST, "message": "params.max_tokens: must be at least 1"}
    )
    assert [result.response for result in (results[0], results[2])] == [{"echo": "short"}, {"echo": "tiny"}]
    assert engine.measured == [["short", "tiny"]]
    assert engine.batches == [["short", "tiny"]]


def test_a_micro_batch_of_only_refused_records_calls_the_engine_not_at_all() -> None:
    engine = LengthLimitedEngine(limit=5)

    results = list(
        run_records(
            engine, [Item("a", None, refused="no"), Item("b", None, refused="no")], params={}, micro_batch_size=8
        )
    )

    assert [result.error for result in results] == [{"code": batching.INVALID_REQUEST, "message": "no"}] * 2
    assert engine.measured == [] and engine.batches == []
