"""The warm model cache: loads once, hits after, evicts the least recently used within its budget.

The cache's subject is bookkeeping, so a test double stands in for real engines here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuworkers import cache as cache_module
from gpuworkers.cache import ModelCache, process_cache
from gpuworkers.engines.base import EngineLoadError
from gpuworkers.spec import ModelSpec

MB = 1_000_000


class SizedEngine:
    """Holds ``spec.load_params["size"]`` bytes once loaded; records what happened to it."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.device: str | None = None
        self.loaded = False

    def load(self, *, device: str) -> None:
        if self.spec.load_params.get("broken"):
            raise EngineLoadError(f"cannot load {self.spec.name}")
        self.device = device
        self.loaded = True

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        return [{} for _ in inputs]

    def memory_bytes(self) -> int:
        return int(self.spec.load_params["size"]) if self.loaded else 0

    def unload(self) -> None:
        self.loaded = False


def spec(name: str, size: int = MB, version: str = "1", **load_params: Any) -> ModelSpec:
    return ModelSpec(
        name=name,
        version=version,
        engine="fake",
        task="embed",
        source="/nowhere",
        load_params={"size": size, **load_params},
    )


def make_cache(budget: int) -> ModelCache:
    return ModelCache(budget_bytes=budget, engine_factory=SizedEngine)


def test_a_model_loads_once_and_the_second_get_is_a_hit() -> None:
    cache = make_cache(10 * MB)

    first = cache.get(spec("a"), device="cpu")
    second = cache.get(spec("a"), device="cpu")

    assert (first.hit, second.hit) == (False, True)
    assert second.engine is first.engine
    assert first.engine.device == "cpu"  # type: ignore[attr-defined]
    assert first.load_seconds >= 0.0 and second.load_seconds == 0.0
    assert cache.loads_of(("a", "1")) == 1
    stats = cache.stats()
    assert (stats.loads, stats.hits, stats.evictions, stats.resident, stats.resident_bytes) == (
        1,
        1,
        0,
        1,
        MB,
    )


def test_another_version_of_a_model_is_another_entry() -> None:
    cache = make_cache(10 * MB)

    cache.get(spec("a", version="1"), device="cpu")
    lookup = cache.get(spec("a", version="2"), device="cpu")

    assert not lookup.hit
    assert cache.loads_of(("a", "1")) == cache.loads_of(("a", "2")) == 1


def test_a_model_never_loaded_before_makes_every_other_model_leave() -> None:
    cache = make_cache(10 * MB)
    a = cache.get(spec("a", MB), device="cpu").engine

    cache.get(spec("b", MB), device="cpu")

    assert not a.loaded  # type: ignore[attr-defined]
    assert (cache.stats().evictions, cache.stats().resident) == (1, 1)


def test_the_least_recently_used_model_is_evicted_to_make_room() -> None:
    cache = make_cache(10 * MB)
    for name in ("a", "b", "c"):  # each first load empties the cache; now every size is known
        cache.get(spec(name, 4 * MB), device="cpu")
    a = cache.get(spec("a", 4 * MB), device="cpu").engine
    b = cache.get(spec("b", 4 * MB), device="cpu").engine  # evicts c
    evictions_before = cache.stats().evictions

    assert cache.get(spec("a", 4 * MB), device="cpu").hit  # a is now the most recently used
    cache.get(spec("c", 4 * MB), device="cpu")

    assert cache.stats().evictions == evictions_before + 1
    assert a.loaded and not b.loaded  # type: ignore[attr-defined]
    assert cache.get(spec("a", 4 * MB), device="cpu").hit
    assert not cache.get(spec("b", 4 * MB), device="cpu").hit
    assert cache.loads_of(("b", "1")) == 3


def test_models_whose_sizes_are_known_share_the_budget() -> None:
    cache = make_cache(10 * MB)
    for name in ("a", "b", "c"):
        cache.get(spec(name, 3 * MB), device="cpu")
    for name in ("a", "b", "c"):
        cache.get(spec(name, 3 * MB), device="cpu")

    assert cache.stats().resident == 3
    assert all(cache.get(spec(name, 3 * MB), device="cpu").hit for name in ("a", "b", "c"))


def test_a_model_larger_than_the_budget_is_still_served() -> None:
    cache = make_cache(2 * MB)
    cache.get(spec("small", MB), device="cpu")

    lookup = cache.get(spec("huge", 5 * MB), device="cpu")

    assert lookup.engine.memory_bytes() == 5 * MB
    assert cache.stats().resident == 1


def test_a_failed_load_propagates_and_is_not_cached() -> None:
    cache = make_cache(10 * MB)

    for _ in range(2):
        with pytest.raises(EngineLoadError, match="cannot load broken"):
            cache.get(spec("broken", broken=True), device="cpu")

    stats = cache.stats()
    assert (stats.loads, stats.resident) == (0, 0)
    assert cache.loads_of(("broken", "1")) == 0


def test_clear_unloads_every_model() -> None:
    cache = make_cache(10 * MB)
    engines = [cache.get(spec(name), device="cpu").engine for name in ("a", "b")]

    cache.clear()

    assert [engine.loaded for engine in engines] == [False, False]  # type: ignore[attr-defined]
    assert cache.stats().resident == 0


def test_the_budget_comes_from_the_environment_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_CACHE_BUDGET_BYTES", str(3 * MB))
    cache = ModelCache(engine_factory=SizedEngine)
    assert cache.stats().budget_bytes is None

    cache.get(spec("a", 2 * MB), device="cpu")
    cache.get(spec("b", 2 * MB), device="cpu")

    assert cache.stats().budget_bytes == 3 * MB
    assert cache.stats().resident == 1


def test_the_process_has_one_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_module, "_process_cache", None)

    assert process_cache() is process_cache()
    assert isinstance(process_cache(), ModelCache)


class StatefulEngine(SizedEngine):
    """Holds the process-wide state named by ``spec.load_params["state"]`` once loaded (`SharesProcessState`)."""

    def process_state(self) -> str | None:
        return self.spec.load_params.get("state")


def test_an_engine_of_process_wide_state_unloads_the_others_holding_it_first_and_leaves_the_rest() -> None:
    cache = ModelCache(budget_bytes=100 * MB, engine_factory=StatefulEngine)
    specs = [spec("first", state="engine-core"), spec("second", state="engine-core"), spec("other")]
    for each in specs:  # each model's size known: a first load of an unknown size makes room for the whole budget
        cache.get(each, device="cpu")
    first = cache.get(specs[0], device="cpu").engine
    assert cache.resident() == [("other", "1"), ("first", "1")]
    evictions = cache.stats().evictions

    second = cache.get(specs[1], device="cpu").engine

    assert cache.resident() == [("other", "1"), ("second", "1")]
    assert not first.loaded and second.loaded  # type: ignore[attr-defined]
    assert cache.stats().evictions == evictions + 1
