"""The micro-batch loop with an engine that queues requests (`Pipelined`): the next micro-batch is in the engine's
queue before the last one's results are read, and the loop's promises hold (order, isolation, stopping)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuworkers.batching import run_records
from gpuworkers.engines.base import Pipelined
from tests.gpuworkers.echo_engines import EchoEngine, items_of


class QueueingEngine(EchoEngine):
    """Echoes through a queue, as vLLM's engine does: `submit_requests` queues a micro-batch, its `result` runs it.
    Records what the queue held each time a micro-batch's results were read, and which ones were cancelled."""

    def __init__(self, bad: frozenset[Any] = frozenset(), refuse_at_submit: frozenset[Any] = frozenset()) -> None:
        super().__init__(bad)
        self.refuse_at_submit = refuse_at_submit
        self.queued: list[list[Any]] = []
        self.held_at_read: list[list[list[Any]]] = []
        self.cancelled: list[list[Any]] = []

    def submit_requests(self, inputs: Sequence[Any], params: Sequence[Mapping[str, Any]]) -> Queued:
        if self.refuse_at_submit & set(inputs):
            raise ValueError(f"cannot queue {sorted(self.refuse_at_submit & set(inputs))}")
        batch = list(inputs)
        self.queued.append(batch)
        return Queued(self, batch, params[0] if params else {})

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        return self.submit_requests(inputs, [params] * len(inputs)).result()


class Queued:
    def __init__(self, engine: QueueingEngine, batch: list[Any], params: Mapping[str, Any]) -> None:
        self.engine, self.batch, self.params = engine, batch, params

    def result(self) -> list[dict[str, Any]]:
        self.engine.held_at_read.append([list(batch) for batch in self.engine.queued])
        self.engine.queued.remove(self.batch)
        return EchoEngine.run_batch(self.engine, self.batch, self.params)

    def cancel(self) -> None:
        self.engine.queued.remove(self.batch)
        self.engine.cancelled.append(self.batch)


def test_the_queueing_engine_is_pipelined() -> None:
    assert isinstance(QueueingEngine(), Pipelined)


def test_the_next_micro_batch_is_queued_before_the_results_of_the_last_are_read() -> None:
    engine = QueueingEngine()

    results = list(run_records(engine, items_of("a", "b", "c", "d", "e"), params={}, micro_batch_size=2))

    assert [result.response for result in results] == [{"echo": value} for value in "abcde"]
    assert engine.held_at_read == [[["a", "b"], ["c", "d"]], [["c", "d"], ["e"]], [["e"]]]
    assert engine.queued == [] and engine.cancelled == []


def test_a_record_that_fails_errors_alone_while_the_next_micro_batch_waits_queued() -> None:
    engine = QueueingEngine(bad=frozenset({"b"}))

    results = list(run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=2))

    assert [result.error is None for result in results] == [True, False, True, True]
    assert results[1].error is not None and "cannot handle 'b'" in results[1].error["message"]
    # The failed batch ran again record by record; the batch queued ahead was read once, as it was.
    assert engine.batches == [["a", "b"], ["a"], ["b"], ["c", "d"]]


def test_a_micro_batch_the_engine_refuses_to_queue_runs_record_by_record() -> None:
    engine = QueueingEngine(refuse_at_submit=frozenset({"c"}))

    results = list(run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=2))

    assert [result.error is None for result in results] == [True, True, False, True]
    assert results[2].error is not None and "cannot queue ['c']" in results[2].error["message"]


def test_a_stop_leaves_the_next_micro_batch_unqueued_and_the_results_read_so_far_stand() -> None:
    engine = QueueingEngine()
    answers = iter([False, True])

    results = list(
        run_records(
            engine,
            items_of("a", "b", "c", "d", "e", "f"),
            params={},
            micro_batch_size=2,
            should_stop=lambda: next(answers),
        )
    )

    assert [result.custom_id for result in results] == ["id-0", "id-1", "id-2", "id-3"]
    assert engine.queued == [] and engine.cancelled == []


def test_a_run_abandoned_between_two_micro_batches_takes_the_one_queued_ahead_out_of_the_engine() -> None:
    engine = QueueingEngine()

    results = run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=2)
    next(results)
    results.close()

    assert engine.cancelled == [["c", "d"]] and engine.queued == []


def test_an_interrupt_while_reading_results_takes_the_queued_micro_batch_out_too() -> None:
    class Interrupted(BaseException):
        pass

    engine = QueueingEngine()
    reads = 0

    def interrupt(done: int, failed: int) -> None:
        nonlocal reads
        reads += 1
        raise Interrupted

    with pytest.raises(Interrupted):
        list(run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=2, on_progress=interrupt))

    assert reads == 1 and engine.cancelled == [["c", "d"]]


def test_an_interrupt_while_queueing_the_next_micro_batch_takes_the_unread_one_out() -> None:
    class Interrupted(Exception):
        pass

    class InterruptedAtSecond(QueueingEngine):
        def submit_requests(self, inputs: Sequence[Any], params: Sequence[Mapping[str, Any]]) -> Queued:
            if self.queued:
                raise Interrupted
            return super().submit_requests(inputs, params)

    engine = InterruptedAtSecond()

    with pytest.raises(Interrupted):
        list(run_records(engine, items_of("a", "b", "c", "d"), params={}, micro_batch_size=2, propagate=(Interrupted,)))

    assert engine.cancelled == [["a", "b"]] and engine.queued == []
