"""Engines: the one small protocol every model runtime implements, and the registry of them."""

from __future__ import annotations

from gpuworkers.engines.base import Engine, EngineLoadError, create_engine

__all__ = ["Engine", "EngineLoadError", "create_engine"]
