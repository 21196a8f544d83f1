"""The process's environment around a benchmark's step: what the step sets is as it was afterwards."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def environment(values: Mapping[str, str] | None = None, *, kept: Collection[str] = ()) -> Iterator[None]:
    """The environment with ``values`` set; afterwards those and the variables named in ``kept`` (which the step
    may set itself) are as they were before."""
    values = values or {}
    before = {name: os.environ.get(name) for name in {*values, *kept}}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
