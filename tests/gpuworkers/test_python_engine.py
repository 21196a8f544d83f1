"""The python engine: a model behind an entry point ``package.module:factory``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from gpuworkers.batching import run_records
from gpuworkers.cache import ModelCache
from gpuworkers.engines import EngineLoadError, create_engine
from gpuworkers.engines.python import PythonEngine
from gpuworkers.faults import StickyDeviceError
from gpuworkers.spec import ModelSpec

HERE = __name__
"""This module's import name, for entry points to the factories below."""

SPEC = ModelSpec(
    name="recorder",
    version="1",
    engine="python",
    task="generate",
    source=f"{HERE}:recording_factory",
    load_params={"prefix": ">"},
)


class RecordingModel:
    """Answers with what its factory was given, so a test can see it without shared state."""

    def __init__(self, *, spec: ModelSpec, device: str) -> None:
        self.spec = spec
        self.device = device
        self.unload_calls = 0

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        prefix = self.spec.load_params["prefix"]
        return [{"text": f"{prefix}{value}", "device": self.device, "params": dict(params)} for value in inputs]

    def memory_bytes(self) -> int:
        return 1234

    def unload(self) -> None:
        self.unload_calls += 1


class BareModel:
    """Only the required method."""

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [{"value": value} for value in inputs]


class Factories:
    @staticmethod
    def bare(*, spec: ModelSpec, device: str) -> BareModel:
        return BareModel()


def recording_factory(*, spec: ModelSpec, device: str) -> RecordingModel:
    return RecordingModel(spec=spec, device=device)


def failing_factory(*, spec: ModelSpec, device: str) -> Any:
    raise FileNotFoundError("weights.bin is missing")


def sticky_factory(*, spec: ModelSpec, device: str) -> Any:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def modelless_factory(*, spec: ModelSpec, device: str) -> Any:
    return object()


NOT_CALLABLE = 42


def loaded(source: str) -> PythonEngine:
    engine = PythonEngine(replace(SPEC, source=source))
    engine.load(device="cpu")
    return engine


def test_the_registry_builds_this_engine_for_its_name() -> None:
    assert isinstance(create_engine(SPEC), PythonEngine)


def test_the_factory_gets_the_spec_and_device_and_the_engine_delegates_to_its_model() -> None:
    engine = create_engine(SPEC)
    engine.load(device="cpu")

    responses = engine.run_batch(["a", "b"], {"temperature": 0})

    assert responses == [
        {"text": ">a", "device": "cpu", "params": {"temperature": 0}},
        {"text": ">b", "device": "cpu", "params": {"temperature": 0}},
    ]
    assert engine.memory_bytes() == 1234


def test_unload_calls_the_models_unload_once_and_drops_it() -> None:
    engine = loaded(f"{HERE}:recording_factory")
    model = engine._model

    engine.unload()
    engine.unload()

    assert model.unload_calls == 1
    with pytest.raises(RuntimeError, match="not loaded"):
        engine.run_batch(["a"], {})


def test_a_model_without_memory_bytes_or_unload_reports_zero_and_unloads_quietly() -> None:
    engine = loaded(f"{HERE}:Factories.bare")

    assert engine.run_batch(["a"], {}) == [{"value": "a"}]
    assert engine.memory_bytes() == 0
    engine.unload()


def test_the_warm_cache_loads_a_python_model_once() -> None:
    cache = ModelCache(budget_bytes=10_000)

    first = cache.get(SPEC, device="cpu")
    second = cache.get(SPEC, device="cpu")

    assert (first.hit, second.hit) == (False, True)
    (result,) = run_records(second.engine, [("1", "x")], params={}, micro_batch_size=4)
    assert result.response == {"text": ">x", "device": "cpu", "params": {}}


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("no_colon_here", "is not an entry point 'package.module:factory'"),
        (f"{HERE}:", "is not an entry point"),
        (":recording_factory", "is not an entry point"),
        (f"{HERE}:a:b", "is not an entry point"),
        ("tests.no_such_module:factory", "cannot import module 'tests.no_such_module': ModuleNotFoundError"),
        (f"{HERE}:no_such_factory", "has no attribute 'no_such_factory'"),
        (f"{HERE}:Factories.missing", "'Factories' has no attribute 'missing'"),
        (f"{HERE}:NOT_CALLABLE", "names a int, not a callable"),
        (f"{HERE}:failing_factory", "failed: FileNotFoundError: weights.bin is missing"),
        (f"{HERE}:modelless_factory", "returned a object, which has no run_batch method"),
    ],
)
def test_a_bad_entry_point_is_an_engine_load_error_naming_the_problem(source: str, problem: str) -> None:
    with pytest.raises(EngineLoadError) as caught:
        loaded(source)

    assert problem in str(caught.value)
    assert source in str(caught.value)


def test_a_factory_that_breaks_the_device_raises_sticky_device_error_not_a_load_error() -> None:
    with pytest.raises(StickyDeviceError):
        loaded(f"{HERE}:sticky_factory")
