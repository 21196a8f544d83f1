"""The simulated model: the `python` engine's factory whose batches take the time a GPU class would.

A record costs `(prompt tokens / PREFILL_SPEEDUP + max_tokens) / tokens_per_s` seconds on its class (a
prompt token is a quarter of a character of the record's messages; prefill runs many times faster than
decoding), times a draw of a log-normal spread per batch and the slowness of the virtual slot that runs
it. The batch sleeps that long and answers a chat response of that many tokens. Free of Django: the
fleet's processes import it.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFILL_SPEEDUP = 10.0
CHARS_PER_TOKEN = 4.0
DEFAULT_MAX_TOKENS = 1024

GPU_CLASSES: dict[str, float] = {"sim-h100": 4000.0, "sim-a100": 2500.0, "sim-l40s": 1500.0, "sim-t4": 600.0}
"""The simulated classes and the decoding tokens a second one slot of each serves (all its sequences together)."""


class SlotVanished(BaseException):
    """Raised in a virtual slot's batch when the slot dies or loses its broker: nothing after it runs,
    as nothing runs in a process that was killed. A BaseException, so no record takes the blame."""


class SlotContext(threading.local):
    """What the running thread's virtual slot says about its speed and its fate."""

    slowness: float = 1.0
    gone: threading.Event | None = None


slot_context = SlotContext()


def record_seconds(chars: int, max_tokens: int, tokens_per_s: float) -> float:
    """A record's time on one slot of a class serving `tokens_per_s`."""
    return (chars / CHARS_PER_TOKEN / PREFILL_SPEEDUP + max_tokens) / tokens_per_s


def cost_params(tokens_per_s: float, max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[str, float]:
    """The catalog's prior for the planner (`seconds_per_record`, `seconds_per_char`): the true cost."""
    return {
        "seconds_per_record": max_tokens / tokens_per_s,
        "seconds_per_char": 1.0 / CHARS_PER_TOKEN / PREFILL_SPEEDUP / tokens_per_s,
    }


def _chars(messages: Any) -> int:
    if isinstance(messages, str):
        return len(messages)
    return sum(len(str(message.get("content", ""))) for message in messages)


@dataclass
class SimulatedModel:
    tokens_per_s: float
    spread: float

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        max_tokens = int(params.get("max_tokens", DEFAULT_MAX_TOKENS))
        chars = [_chars(messages) for messages in inputs]
        seconds = sum(record_seconds(n, max_tokens, self.tokens_per_s) for n in chars)
        draw = math.exp(random.gauss(0.0, self.spread)) if self.spread else 1.0
        if (slot_context.gone or threading.Event()).wait(seconds * draw * slot_context.slowness):
            raise SlotVanished
        return [_response(n, max_tokens) for n in chars]

    def memory_bytes(self) -> int:
        return 0


def _response(chars: int, max_tokens: int) -> dict[str, Any]:
    prompt_tokens = max(1, round(chars / CHARS_PER_TOKEN))
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": max_tokens,
        "total_tokens": prompt_tokens + max_tokens,
    }
    return {
        "text": f"simulated answer of {max_tokens} tokens",
        "finish_reason": "length",
        "usage": usage,
    }


def factory(*, spec: Any, device: str) -> SimulatedModel:
    """Built by the `python` engine: the speed from the catalog entry's load params."""
    return SimulatedModel(
        tokens_per_s=float(spec.load_params["tokens_per_s"]), spread=float(spec.load_params.get("spread", 0.1))
    )
