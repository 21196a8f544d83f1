"""Models that misbehave on purpose, for the fault-tolerance (chaos) tests, run through the python engine.

Each factory is an entry point for a catalog source such as ``tests.support.chaos_engines:poison_factory``.
Every model echoes its text inputs (``{"echo": text, "length": len(text)}``) and misbehaves only on
a marker in a record's text or a param, so a test decides exactly which records trip it. None needs
torch, apart from `oom_factory`, which raises torch's own out-of-memory error where torch is installed.

Run-time params every model reads: ``sleep_per_record`` (seconds, default 0) slows each record
down, for deadline and cancel tests, and ``sleep_per_char`` each character of it; a worker whose
environment sets CHAOS_SLOWDOWN (a factor) sleeps that many times longer, as a slow GPU would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

POISON_MARKER = "POISON"
"""A record holding it makes `poison_factory`'s model abort the process (SIGABRT)."""

HANG_MARKER = "HANG"
"""A record holding it makes `hang_factory`'s model block forever."""

FLAKY_MARKER = "FLAKY"
"""A record holding it makes `flaky_factory`'s model fail until its ``fixed_when_exists`` file exists."""

STICKY_MARKER = "STICKY"
"""A record holding it makes `sticky_factory`'s model raise a CUDA illegal-memory-access error."""

DEFAULT_OOM_ABOVE_CHARS = 200
"""`oom_factory`'s model runs out of memory on a batch of more characters than this (``oom_above_chars``)."""

STICKY_MESSAGE = "CUDA error: an illegal memory access was encountered"
"""The message of the error `sticky_factory`'s model raises: the text torch gives for cudaErrorIllegalAddress."""


class EchoModel:
    """Answers ``{"echo": text, "length": len(text)}`` per input; subclasses misbehave in `check`."""

    def __init__(self, *, device: str) -> None:
        self.device = device
        self.batches: list[list[str]] = []
        self.unloaded = False

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        texts = [_require_text(value) for value in inputs]
        self.batches.append(texts)
        self.check(texts, params)
        slowdown = float(os.environ.get("CHAOS_SLOWDOWN", "1"))
        sleep_per_record = float(params.get("sleep_per_record", 0)) * slowdown
        sleep_per_char = float(params.get("sleep_per_char", 0)) * slowdown
        responses = []
        for text in texts:
            self.check_record(text)
            if sleep_per_record > 0 or sleep_per_char > 0:
                time.sleep(sleep_per_record + sleep_per_char * len(text))
            responses.append({"echo": text, "length": len(text)})
        return responses

    def check(self, texts: list[str], params: Mapping[str, Any]) -> None:
        """Misbehave for the whole batch, before any record runs."""

    def check_record(self, text: str) -> None:
        """Misbehave for one record, in input order."""

    def memory_bytes(self) -> int:
        return 0

    def unload(self) -> None:
        self.unloaded = True


class PoisonModel(EchoModel):
    def check_record(self, text: str) -> None:
        if POISON_MARKER in text:
            # Like a segfault in native code: no exception, no cleanup, the process is gone.
            os.abort()


class OutOfMemoryModel(EchoModel):
    def check(self, texts: list[str], params: Mapping[str, Any]) -> None:
        limit = int(params.get("oom_above_chars", DEFAULT_OOM_ABOVE_CHARS))
        total = sum(len(text) for text in texts)
        if total > limit:
            raise out_of_memory_error(f"CUDA out of memory. Tried to allocate {total} chars; the limit is {limit}")


class HangModel(EchoModel):
    def check_record(self, text: str) -> None:
        if HANG_MARKER in text:
            # A blocking call, as a stuck kernel or collective would be: only a hard time limit ends it.
            while True:
                time.sleep(3600)


class StickyModel(EchoModel):
    """After the first sticky error every batch fails with it, as on a real broken CUDA context."""

    def __init__(self, *, device: str) -> None:
        super().__init__(device=device)
        self.broken = False

    def check(self, texts: list[str], params: Mapping[str, Any]) -> None:
        if self.broken or any(STICKY_MARKER in text for text in texts):
            self.broken = True
            raise RuntimeError(STICKY_MESSAGE)


class FlakyModel(EchoModel):
    """Fails records holding `FLAKY_MARKER` until the file named by the ``fixed_when_exists`` param
    exists: a fault that a later retry no longer meets."""

    def check(self, texts: list[str], params: Mapping[str, Any]) -> None:
        fixed = params.get("fixed_when_exists")
        if any(FLAKY_MARKER in text for text in texts) and not (fixed and os.path.exists(fixed)):
            raise RuntimeError("the flaky dependency is down")


def echo_factory(*, spec: Any, device: str) -> EchoModel:
    return EchoModel(device=device)


def poison_factory(*, spec: Any, device: str) -> PoisonModel:
    return PoisonModel(device=device)


def oom_factory(*, spec: Any, device: str) -> OutOfMemoryModel:
    return OutOfMemoryModel(device=device)


def hang_factory(*, spec: Any, device: str) -> HangModel:
    return HangModel(device=device)


def sticky_factory(*, spec: Any, device: str) -> StickyModel:
    return StickyModel(device=device)


def flaky_factory(*, spec: Any, device: str) -> FlakyModel:
    return FlakyModel(device=device)


def out_of_memory_error(message: str) -> Exception:
    """torch's `OutOfMemoryError` with ``message`` where torch is installed, else a `MemoryError`."""
    try:
        import torch
    except ImportError:
        return MemoryError(message)
    error: Exception = torch.OutOfMemoryError(message)
    return error


FRAGILE_REGISTRY: set[str] = set()
"""What `tests.support.fragile_import` registers when imported, as torch registers its operators."""


def fragile_import_factory(*, spec: Any, device: str) -> EchoModel:
    """Imports `tests.support.fragile_import`, which cannot be imported twice in a process, slowly
    the first time in a test: the ``first_import_marker`` load param names a file made then."""
    import importlib

    os.environ["CHAOS_FIRST_IMPORT_MARKER"] = spec.load_params["first_import_marker"]
    importlib.import_module("tests.support.fragile_import")
    return EchoModel(device=device)


def slow_load_factory(*, spec: Any, device: str) -> EchoModel:
    """An echo model that takes ``load_seconds`` (a load param) to load, as real weights do."""
    time.sleep(float(spec.load_params.get("load_seconds", 0)))
    return EchoModel(device=device)


def _require_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"the input must be a string, not {type(value).__name__}")
    return value
