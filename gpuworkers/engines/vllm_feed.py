"""vLLM's engine stepped by the slot: a micro-batch's requests join the engine's queue while the one before
still runs, and each micro-batch's outputs are read back as its own requests finish.

`LLM.generate` and `LLM.chat` add their prompts and step the engine until it holds no request, so the engine
drains at the end of every call: its batch shrinks to the slowest request of the micro-batch while the next one
waits outside. A `VllmFeed` adds requests (`LLM.enqueue`, `LLM.enqueue_chat`) and steps the engine only until
the requests asked for have finished (`wait`); the others stay in the running batch, their outputs kept until
asked for. Requests no one will ask for (an abandoned shard's) are aborted (`abort`).

The feed counts what the engine held at each step (`occupancy`): the measure of how well it is kept fed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Occupancy:
    """What the engine held over the steps this feed took."""

    steps: int = 0
    requests: int = 0
    """Requests the engine held (running or waiting) summed over the steps."""

    @property
    def mean(self) -> float:
        """Requests the engine held at a step, on average."""
        return self.requests / self.steps if self.steps else 0.0


class VllmFeed:
    """One loaded `vllm.LLM`'s requests and finished outputs; not thread-safe (a slot runs one shard at a time)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self._finished: dict[str, Any] = {}
        self.occupancy = Occupancy()

    def add(self, enqueue: Callable[[Any], Sequence[str]]) -> list[str]:
        """Call ``enqueue(llm)`` (which adds requests with `LLM.enqueue` or `LLM.enqueue_chat`); return the ids
        their outputs will carry, in the order they were added."""
        return [_external_id(request_id) for request_id in enqueue(self._llm)]

    def wait(self, ids: Sequence[str]) -> list[Any]:
        """The finished outputs of the requests `ids`, in that order, stepping the engine until each has finished.
        Whatever stops it aborts those requests (their outputs would never be asked for)."""
        engine = self._llm.llm_engine
        wanted = set(ids).difference(self._finished)
        try:
            while wanted:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM holds none of the {len(wanted)} requests still awaited")
                self.occupancy.steps += 1
                self.occupancy.requests += engine.get_num_unfinished_requests()
                for output in engine.step():
                    if output.finished:
                        self._finished[output.request_id] = output
                        wanted.discard(output.request_id)
        except BaseException:
            self.abort(ids)
            raise
        return [self._finished.pop(request_id) for request_id in ids]

    def abort(self, ids: Sequence[str]) -> None:
        """Drop the requests `ids`: those still running leave the engine, finished outputs are forgotten."""
        running = [request_id for request_id in ids if self._finished.pop(request_id, None) is None]
        if running:
            self._llm.llm_engine.abort_request(running)


def _external_id(request_id: str) -> str:
    """The id a request's outputs carry: the one `LLM` gave it. `enqueue` returns the engine's internal id, that
    id with a random suffix (``"7-1a2b3c4d"``); `LLM`'s own ids are counter values, which hold no dash."""
    return request_id.rpartition("-")[0] or request_id
