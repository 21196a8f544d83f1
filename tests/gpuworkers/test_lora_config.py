"""The allow-list of an adapter's config (`gpuworkers.engines.lora_config`), which registration and the slot
share: what is kept, what is dropped, what is refused naming the key, and the config PEFT is given."""

from __future__ import annotations

from typing import Any

import pytest

from gpuworkers.engines.lora_config import LoraConfigRefused, lora_fields, rebuilt_config

PLAIN: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
MODULES = {"model.layers.0.self_attn.q_proj": 4, "model.layers.0.self_attn.v_proj": 4}


def _refusal(config: dict[str, Any], *, max_rank: int | None = 64, modules: dict[str, int] = MODULES) -> str:
    with pytest.raises(LoraConfigRefused) as refused:
        rebuilt_config(lora_fields(config, max_rank=max_rank), modules)
    return refused.value.field


def test_peft_bookkeeping_and_options_written_empty_are_dropped_and_the_rest_rebuilt() -> None:
    config = {
        **PLAIN,
        "peft_version": "0.21.2",
        "auto_mapping": {"base_model_class": "LlamaForCausalLM"},
        "base_model_name_or_path": "/somewhere/else",
        "eva_config": None,
        "loftq_config": {},
        "use_dora": False,
        "layers_to_transform": [],
        "init_lora_weights": "gaussian",
    }
    rebuilt = rebuilt_config(lora_fields(config, max_rank=64), MODULES)

    assert rebuilt["target_modules"] == sorted(MODULES)
    assert rebuilt["init_lora_weights"] is True
    assert "base_model_name_or_path" not in rebuilt and "eva_config" not in rebuilt


def test_ranks_and_alphas_come_from_the_weights_under_escaped_full_paths() -> None:
    config = {**PLAIN, "rank_pattern": {"v_proj": 8}, "alpha_pattern": {"layers.0.self_attn.v_proj": 32}}
    modules = {**MODULES, "model.layers.0.self_attn.v_proj": 8}
    rebuilt = rebuilt_config(lora_fields(config, max_rank=None), modules)

    assert rebuilt["rank_pattern"] == {r"model\.layers\.0\.self_attn\.v_proj": 8}
    assert rebuilt["alpha_pattern"] == {r"model\.layers\.0\.self_attn\.v_proj": 32.0}


def test_what_a_config_may_not_ask_is_refused_naming_the_key() -> None:
    assert _refusal({**PLAIN, "init_lora_weights": "pissa"}) == "init_lora_weights"
    assert _refusal({**PLAIN, "init_lora_weights": 1}) == "init_lora_weights"
    assert _refusal({**PLAIN, "target_modules": "all-linear"}) == "target_modules"
    assert _refusal({**PLAIN, "layer_replication": [[0, 1]]}) == "layer_replication"
    assert _refusal({**PLAIN, "rank_pattern": ["v_proj"]}) == "rank_pattern"
    assert _refusal({**PLAIN, "rank_pattern": {"v_proj": 10**6}}) == "rank_pattern.v_proj"
    assert _refusal({**PLAIN, "r": True}) == "r"
    assert _refusal({**PLAIN, "lora_alpha": float("nan")}) == "lora_alpha"
    # The weights must be what the config says: each module targeted, of the rank the config gives it.
    assert _refusal({**PLAIN, "target_modules": ["q_proj"]}) == "target_modules"
    assert _refusal({**PLAIN, "rank_pattern": {"v_proj": 8}}) == "rank_pattern"
    assert _refusal(PLAIN, modules={}) == "target_modules"
