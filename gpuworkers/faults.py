"""Device faults that end a worker process: recognising the CUDA errors no retry in-process survives.

After an illegal memory access, a device-side assert or a lost GPU, the process's CUDA context is
unusable: every later kernel launch fails with the same error. Isolating such an error per record
would turn one fault into an error line for every record that follows, so the micro-batch loop
raises `StickyDeviceError` instead, and the shard task makes the worker exit for a fresh one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

ERROR_MARKERS: tuple[str, ...] = (
    "illegal memory access",
    "device-side assert triggered",
    "unspecified launch failure",
    "an illegal instruction",
    "misaligned address",
    "invalid program counter",
    "hardware stack error",
    "launch timed out",
    "uncorrectable ecc error",
    "device lost",
    "gpu is lost",
    "cuda driver error",
)
"""Lower-case fragments of the messages of CUDA errors that leave the context unusable."""

DEAD_ENGINE_ERRORS: frozenset[str] = frozenset({"EngineDeadError"})
"""Names of errors raised once an engine's own background process died (vLLM's): like a broken
CUDA context, nothing in this process recovers, so the worker must exit."""

_CHAIN_LIMIT = 8
"""Causes followed from the raised exception; engines wrap device errors a level or two deep at most."""


class StickyDeviceError(Exception):
    """The device's context is broken (chained to the original error): the worker process must exit."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during, nearest first (at most `_CHAIN_LIMIT`)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < _CHAIN_LIMIT:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def raised_from(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """True when ``exc`` or an exception in its chain is one of ``kinds`` (an engine may wrap an interrupt)."""
    return any(isinstance(link, kinds) for link in exception_chain(exc))


def is_sticky_device_error(exc: BaseException) -> bool:
    """True when ``exc``, or an exception it was raised from, is a CUDA error that poisons the context.

    Only `RuntimeError` is looked at (torch's `AcceleratorError` is one, and so are the CUDA errors of
    older torch and of vLLM): a `ValueError` that quotes a record holding "illegal memory access"
    must stay a bad record, not take the worker down.
    """
    for link in exception_chain(exc):
        if type(link).__name__ in DEAD_ENGINE_ERRORS:
            return True
        if isinstance(link, RuntimeError) and not _is_torch_out_of_memory(link):
            message = str(link).lower()
            if any(marker in message for marker in ERROR_MARKERS):
                return True
    return False


def _is_torch_out_of_memory(exc: BaseException) -> bool:
    # torch's OutOfMemoryError is a RuntimeError too, but smaller batches recover from it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, torch.OutOfMemoryError)
