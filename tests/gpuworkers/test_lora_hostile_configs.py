"""A LoRA adapter whose stored config asks PEFT to act on the base model (``init_lora_weights: pissa``,
``all-linear``, ``layer_replication``, huge ``rank_pattern`` ranks…) cannot change the weights other tenants'
records run on: the slot builds the config PEFT gets from the checked fields, refuses what it does not load,
and, should anything still change the base weights, refuses that adapter and loads its base model again.
The vllm engine, which reads the stored config itself, checks it against the same allow-list first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpuworkers.batching import ENGINE_ERROR, Item, run_records
from gpuworkers.engines import lora
from gpuworkers.engines.base import ADAPTER_PARAM, EngineLoadError
from gpuworkers.engines.transformers import TransformersEngine
from gpuworkers.engines.vllm_lora import VllmLoras
from gpuworkers.spec import AdapterSpec, ModelSpec
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora

PROMPTS = ["Hello there", "x", "A longer prompt, to pad the others", "GPUs"]
GREEDY = {"max_tokens": 8, "temperature": 0}
HOSTILE = {
    "pissa on every linear layer": (
        {"init_lora_weights": "pissa", "target_modules": "all-linear"},
        "init_lora_weights",
    ),
    "every linear layer": ({"target_modules": "all-linear"}, "target_modules"),
    "pissa on its own module": ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    "pissa with a few iterations": ({"init_lora_weights": "pissa_niter_2"}, "init_lora_weights"),
    "olora": ({"init_lora_weights": "olora"}, "init_lora_weights"),
    "corda": ({"init_lora_weights": "corda"}, "init_lora_weights"),
    "orthogonal": ({"init_lora_weights": "orthogonal"}, "init_lora_weights"),
    "layer replication": ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    "a rank of a million": ({"rank_pattern": {"c_attn": 1_000_000}}, "rank_pattern"),
    "a rank pattern that is a list": ({"rank_pattern": [["c_attn", 4]]}, "rank_pattern"),
    "a pattern key": ({"alpha_pattern": {"(a+)+$": 4}}, "alpha_pattern"),
    "bias terms": ({"bias": "all"}, "bias"),
    "modules to save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    base = build_tiny_causal_lm(root / "base")
    return {"base": base, "good": build_tiny_lora(base, root / "good", seed=5), "root": root}


def _engine(base: Path) -> TransformersEngine:
    engine = TransformersEngine(
        ModelSpec(name="tiny-base", version="1", engine="transformers", task="generate", source=str(base))
    )
    engine.load(device="cpu")
    return engine


def _stored_raw(good: Path, target: Path, **changes: Any) -> Path:
    """An adapter as one registered before configs were rebuilt would be stored: its weights, and its config
    as the tenant wrote it."""
    shutil.copytree(good, target)
    config = json.loads((good / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return target


def _adapter(directory: Path, name: str) -> dict[str, Any]:
    return AdapterSpec(name=name, version="1", source=str(directory), rank=4).to_dict()


def _texts(engine: TransformersEngine, params: dict[str, Any]) -> list[str]:
    return [response["text"] for response in engine.run_batch(PROMPTS, params)]


def test_a_stored_hostile_config_fails_its_records_naming_the_field_and_the_base_answers_as_before(
    tiny: dict[str, Path],
) -> None:
    engine = _engine(tiny["base"])
    good = {**GREEDY, ADAPTER_PARAM: _adapter(tiny["good"], "good")}
    before, good_before = _texts(engine, GREEDY), _texts(engine, good)
    assert engine._adapters is not None
    digest = lora.base_digest(engine._adapters.model)
    for n, (what, (changes, field)) in enumerate(HOSTILE.items()):
        hostile = _stored_raw(tiny["good"], tiny["root"] / f"hostile-{n}", **changes)
        items = [
            Item("victim", "Hello there", {}),
            Item("attacker", "Hello there", {ADAPTER_PARAM: _adapter(hostile, f"hostile-{n}")}),
        ]
        victim, attacker = run_records(engine, items, params=GREEDY, micro_batch_size=8)

        assert victim.response is not None, what
        assert _texts(engine, GREEDY) == before, what
        assert _texts(engine, good) == good_before, what
        assert attacker.error is not None and attacker.error["code"] == ENGINE_ERROR, what
        assert f"adapter_config.json: {field}" in attacker.error["message"], (what, attacker.error["message"])
    assert lora.base_digest(engine._adapters.model) == digest


def test_an_adapter_that_changes_the_base_weights_anyway_is_refused_and_the_base_model_is_loaded_again(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hole in the allow-list, made on purpose: PEFT gets the stored config as it came.
    from peft import LoraConfig

    monkeypatch.setattr(lora, "adapter_config", lambda path: LoraConfig.from_pretrained(str(path)))
    engine = _engine(tiny["base"])
    good = {**GREEDY, ADAPTER_PARAM: _adapter(tiny["good"], "good")}
    before, good_before = _texts(engine, GREEDY), _texts(engine, good)
    # pissa loads; olora rewrites the weights and then fails to load the matrices (a half-done load).
    for name, init in (("pissa", "pissa"), ("olora", "olora")):
        hostile = _stored_raw(tiny["good"], tiny["root"] / name, init_lora_weights=init, target_modules="all-linear")
        items = [
            Item(f"attacker-{n}", prompt, {ADAPTER_PARAM: _adapter(hostile, name)}) for n, prompt in enumerate(PROMPTS)
        ]
        results = list(run_records(engine, items, params=GREEDY, micro_batch_size=8))

        assert _texts(engine, GREEDY) == before, name
        assert _texts(engine, good) == good_before, name
        for result in results:
            assert result.error is not None and result.error["code"] == ENGINE_ERROR
            assert "loading it changed the base model's weights" in result.error["message"], result.error["message"]
        assert engine._adapters is not None
        assert AdapterSpec.from_dict(_adapter(hostile, name)).fingerprint in engine._adapters.refused


def test_the_vllm_engine_refuses_a_stored_hostile_config_before_vllm_reads_it(tiny: dict[str, Path]) -> None:
    # vLLM reads the stored config itself: the allow-list runs first, with vLLM's own max_lora_rank.
    loras = VllmLoras("tiny-base", {"enable_lora": True, "max_lora_rank": 16})
    for n, (changes, field) in enumerate(HOSTILE.values()):
        hostile = _stored_raw(tiny["good"], tiny["root"] / f"vllm-hostile-{n}", **changes)
        with pytest.raises(EngineLoadError, match=f"adapter_config.json: {field}"):
            loras.request(_adapter(hostile, f"hostile-{n}"))
    narrow = VllmLoras("tiny-base", {"enable_lora": True, "max_lora_rank": 2})
    with pytest.raises(EngineLoadError, match=r"r is 4, over the highest rank served here \(2\)"):
        narrow.request(_adapter(tiny["good"], "good"))
    assert loras.loaded == [] and narrow.loaded == []
