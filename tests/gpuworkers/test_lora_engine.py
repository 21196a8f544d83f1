"""LoRA adapters on the transformers engine: several adapters on one warm base model, each record's answer
the one its adapter gives alone (a model with that adapter merged into its weights, run by a plain engine)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.batching import ENGINE_ERROR, Item, run_records
from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.spec import AdapterSpec, ModelSpec
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora

PROMPTS = ["Hello there", "x", "A longer prompt, to pad the others", "GPUs", "Medium prompt"]
GREEDY = {"max_tokens": 8, "temperature": 0}


def _spec(source: Path, name: str = "tiny-base") -> ModelSpec:
    return ModelSpec(name=name, version="1", engine="transformers", task="generate", source=str(source))


def _adapter(directory: Path, name: str) -> dict[str, Any]:
    return AdapterSpec(name=name, version="1", source=str(directory), rank=4).to_dict()


def _held(tiny: dict[str, Path], *names: str) -> list[str]:
    """The fingerprints an engine keeps these adapters under (`AdapterSpec.fingerprint`), in this order."""
    return [AdapterSpec.from_dict(_adapter(tiny[name], name)).fingerprint for name in names]


def _merged(base: Path, adapter: Path, target: Path) -> Path:
    """The base model with the adapter merged into its weights, saved as a model of its own."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
    merged.save_pretrained(target)
    AutoTokenizer.from_pretrained(base).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_causal_lm(root / "base")
    paths = {"base": base}
    for seed, name in enumerate(("alpha", "beta", "gamma")):
        paths[name] = build_tiny_lora(base, root / name, seed=seed)
        paths[f"{name}-merged"] = _merged(base, paths[name], root / f"{name}-merged")
    return paths


def _texts(engine: TransformersEngine, params: dict[str, Any]) -> list[str]:
    return [response["text"] for response in engine.run_batch(PROMPTS, params)]


def test_each_adapter_answers_as_the_model_with_it_merged_alone_and_none_as_the_base(tiny: dict[str, Path]) -> None:
    engine = TransformersEngine(_spec(tiny["base"]))
    engine.load(device="cpu")
    answers = {}
    for name in ("alpha", "beta", "gamma"):
        alone = TransformersEngine(_spec(tiny[f"{name}-merged"], name=f"{name}-merged"))
        alone.load(device="cpu")
        answers[name] = _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny[name], name)})
        assert answers[name] == _texts(alone, GREEDY)
    plain = TransformersEngine(_spec(tiny["base"]))
    plain.load(device="cpu")
    assert _texts(engine, GREEDY) == _texts(plain, GREEDY)
    # The adapters change the answers, or the comparisons above would prove nothing.
    assert len({tuple(texts) for texts in [*answers.values(), _texts(plain, GREEDY)]}) == 4


def test_records_of_different_adapters_in_one_micro_batch_each_get_their_own_adapters_answer(
    tiny: dict[str, Path],
) -> None:
    engine = TransformersEngine(_spec(tiny["base"]))
    engine.load(device="cpu")
    names = ["alpha", None, "gamma", "beta", "alpha"]
    items = [
        Item(f"r{n}", prompt, {ADAPTER_PARAM: None if name is None else _adapter(tiny[name], name)})
        for n, (prompt, name) in enumerate(zip(PROMPTS, names, strict=True))
    ]
    results = list(run_records(engine, items, params=GREEDY, micro_batch_size=8))

    for result, prompt, name in zip(results, PROMPTS, names, strict=True):
        params = GREEDY if name is None else {**GREEDY, ADAPTER_PARAM: _adapter(tiny[name], name)}
        assert result.response is not None
        assert result.response["text"] == engine.run_batch([prompt], params)[0]["text"]
    assert engine._adapters is not None
    assert sorted(engine._adapters.loaded) == sorted(_held(tiny, "alpha", "beta", "gamma"))
    assert engine.loaded_adapters() == engine._adapters.loaded, "what the slot's heartbeat reports"


def test_past_the_limit_the_least_recently_used_adapter_is_dropped_and_loaded_again_when_asked(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_LORAS", "2")
    engine = TransformersEngine(_spec(tiny["base"]))
    engine.load(device="cpu")
    first = _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny["alpha"], "alpha")})
    for name in ("beta", "gamma"):
        _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny[name], name)})
    assert engine._adapters is not None
    assert engine._adapters.loaded == _held(tiny, "beta", "gamma")

    assert _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny["alpha"], "alpha")}) == first
    assert engine._adapters.loaded == _held(tiny, "gamma", "alpha")


def test_two_tenants_adapters_of_one_name_and_version_are_kept_apart(tiny: dict[str, Path]) -> None:
    # Names are unique per owner only: one slot may serve acme's "alpha@1" and globex's.
    engine = TransformersEngine(_spec(tiny["base"]))
    engine.load(device="cpu")
    acme = _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny["alpha"], "alpha")})
    globex = _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny["beta"], "alpha")})

    assert globex == _texts(engine, {**GREEDY, ADAPTER_PARAM: _adapter(tiny["beta"], "beta")})
    assert acme != globex


def test_an_adapter_without_safetensors_weights_fails_its_records_alone(tiny: dict[str, Path], tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny["alpha"], pickled)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    engine = TransformersEngine(_spec(tiny["base"]))
    engine.load(device="cpu")
    items = [
        Item("good", "Hello", {ADAPTER_PARAM: _adapter(tiny["beta"], "beta")}),
        Item("bad", "Hello", {ADAPTER_PARAM: _adapter(pickled, "pickled")}),
    ]
    good, bad = run_records(engine, items, params=GREEDY, micro_batch_size=8)

    assert good.response is not None
    assert bad.error is not None and bad.error["code"] == ENGINE_ERROR
    assert "only safetensors" in bad.error["message"]


def test_a_shared_prefix_is_computed_apart_under_each_adapter_and_answers_as_without_reuse(
    tiny: dict[str, Path],
) -> None:
    preamble = "You are a terse assistant. Answer in a few words only. "
    prompts = [preamble + question for question in ("Why?", "How so?", "When?")]
    engine = TransformersEngine(_spec(tiny["base"]))
    engine.load(device="cpu")
    for adapter in (_adapter(tiny["alpha"], "alpha"), None, _adapter(tiny["beta"], "beta")):
        params = {**GREEDY, ADAPTER_PARAM: adapter}
        reused = engine.run_batch(prompts, params)
        plain = engine.run_batch(prompts, {**params, "prefix_reuse": False})
        assert [response["text"] for response in reused] == [response["text"] for response in plain]
        cached = [response["usage"]["prompt_tokens_details"]["cached_tokens"] for response in reused]
        assert cached[0] == 0 and min(cached[1:]) >= 48, "the first of each adapter computes the preamble"
