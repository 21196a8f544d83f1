"""One way into NVML for discovery and telemetry: a session, or None where NVML is missing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def nvml_session() -> Iterator[Any]:
    """Yield the `pynvml` module with NVML initialised, or None where it is not installed or fails."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()
