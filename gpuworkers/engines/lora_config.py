"""What a LoRA adapter's ``adapter_config.json`` may ask of the model it is loaded into: an allow-list.

PEFT does more than load two matrices when a config asks: ``init_lora_weights`` of ``pissa``, ``olora`` or
``corda`` rewrite the base layer's weights in place, ``layer_replication`` restructures the model,
``target_modules: "all-linear"`` wraps every linear layer, and ``rank_pattern`` sizes what it allocates.
On a warm slot those act on the weights every tenant's records run on. So the catalog (at registration) and
the slot (at every load, for adapters stored before this check) never hand PEFT a config as it came: they
check it with `lora_fields` and build the one PEFT gets with `rebuilt_config`, from the fields below only.

Kept, checked: ``peft_type`` (``LORA``), ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` (a list
of module names), ``bias`` (``none``), ``fan_in_fan_out``, ``use_rslora``, ``task_type`` (none or
``CAUSAL_LM``), ``rank_pattern`` / ``alpha_pattern`` (objects of module name to number, each rank bounded),
``init_lora_weights`` (``true``, ``false`` or ``gaussian``: they set the new matrices only, which the loaded
weights overwrite; the rebuilt config says ``true``). Dropped: PEFT's bookkeeping (`_METADATA`), which
describes where the adapter was trained and asks nothing of the model, and any other key whose value is
empty (null, false, ``{}``, ``[]``, ``""``), which is how PEFT writes a feature it does not use: the rebuilt
config leaves it at PEFT's default, off. Any other key with a value is refused, naming it: Batchery serves
plain LoRA matrices, and a feature PEFT adds next year must not act on a slot before someone reads it.

This module is pure (no torch, no PEFT) so that the portal checks uploads with the rules the slot loads by.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 64 * 1024
"""The most of a config read, at registration and on a slot: one is a few hundred bytes."""

_METADATA = frozenset(
    {
        "auto_mapping",
        "base_model_name_or_path",
        "inference_mode",
        "megatron_core",
        "peft_version",
        "qalora_group_size",
        "revision",
    }
)
"""PEFT's bookkeeping: where the adapter was trained, and defaults of features that are off."""
_KEPT = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "bias",
        "fan_in_fan_out",
        "use_rslora",
        "task_type",
        "init_lora_weights",
        "rank_pattern",
        "alpha_pattern",
    }
)
_HARMLESS_INIT = (True, False, "gaussian")
"""``init_lora_weights`` values that draw the new A and B matrices only (then overwritten by the loaded
weights); the others (``pissa``, ``olora``, ``corda``, ``loftq``, ``eva``, ``orthogonal``…) compute from, or
rewrite, the base layer's weights."""
_TASK_TYPES = (None, "CAUSAL_LM")
_MODULE_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
"""A module's name or the dotted tail of one. PEFT reads pattern keys as regular expressions; only plain
names are taken, so that nothing a tenant writes is run as a pattern (nor backtracks for minutes)."""
MAX_ALPHA = 1_000_000.0
"""The largest ``lora_alpha`` taken: it only scales the adapter's own output, but an infinite or absurd
scale is a mistake to name, not to run."""


class LoraConfigRefused(Exception):
    """The adapter's config asks for something Batchery does not load; ``field`` names the key at fault."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class LoraFields:
    """The part of an ``adapter_config.json`` Batchery loads, checked: everything else was dropped."""

    rank: int
    """``r``: the rank of every module ``rank_pattern`` does not name."""
    alpha: float
    """``lora_alpha``: the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with rsLoRA)."""
    dropout: float
    target_modules: tuple[str, ...]
    """The module names the config targets; each matrix pair of the weights must be one of them."""
    fan_in_fan_out: bool
    """True for GPT-2's Conv1D, which keeps its weight as (in, out)."""
    use_rslora: bool
    task_type: str | None
    rank_pattern: tuple[tuple[str, int], ...]
    """(module name, rank) in the config's order: the first that names a module gives its rank."""
    alpha_pattern: tuple[tuple[str, float], ...]

    def rank_for(self, module: str) -> int:
        """The rank the config gives ``module`` (a full module path)."""
        return next((rank for key, rank in self.rank_pattern if _names(key, module)), self.rank)

    def alpha_for(self, module: str) -> float:
        return next((alpha for key, alpha in self.alpha_pattern if _names(key, module)), self.alpha)

    def targets(self, module: str) -> bool:
        return any(_names(key, module) for key in self.target_modules)


def _names(key: str, module: str) -> bool:
    # PEFT's rule for a module name in a list: the whole path, or its tail after a dot.
    return module == key or module.endswith("." + key)


def _empty(value: Any) -> bool:
    return value is None or value is False or value in ({}, [], "")


def _refused(field: str, problem: str) -> LoraConfigRefused:
    return LoraConfigRefused(f"{CONFIG_FILE}: {field} {problem}", field=field)


def lora_fields(config: Mapping[str, Any], *, max_rank: int | None) -> LoraFields:
    """The checked fields of a parsed ``adapter_config.json``; raises `LoraConfigRefused` naming the key.

    ``max_rank`` bounds ``r`` and every ``rank_pattern`` rank (None: bounded by the weights alone, as on a
    slot, where the rebuilt config takes each module's rank from its matrices)."""
    for key, value in config.items():
        if key in _KEPT or key in _METADATA or _empty(value):
            continue
        raise _refused(
            str(key)[:100],
            f"is set ({_shown(value)}); only plain LoRA adapters (A and B matrices) are served, and this "
            "option is not one Batchery loads",
        )
    if config.get("peft_type") != "LORA":
        raise _refused("peft_type", f"must be 'LORA', not {_shown(config.get('peft_type'))}")
    rank = _rank("r", config.get("r"), max_rank)
    bias = config.get("bias", "none")
    if bias not in ("none", None):
        raise _refused("bias", f"must be 'none', not {_shown(bias)}: bias terms would change the base layers")
    init = config.get("init_lora_weights", True)
    if not any(init is harmless or (isinstance(init, str) and init == harmless) for harmless in _HARMLESS_INIT):
        raise _refused(
            "init_lora_weights",
            f"is {_shown(init)}; only true, false or 'gaussian' are taken (the others compute from or rewrite "
            "the base model's weights)",
        )
    task_type = config.get("task_type")
    if task_type not in _TASK_TYPES:
        raise _refused("task_type", f"must be null or 'CAUSAL_LM', not {_shown(task_type)}")
    return LoraFields(
        rank=rank,
        alpha=_alpha("lora_alpha", config.get("lora_alpha", 8)),
        dropout=_dropout(config.get("lora_dropout", 0.0)),
        target_modules=_target_modules(config.get("target_modules")),
        fan_in_fan_out=_flag(config, "fan_in_fan_out"),
        use_rslora=_flag(config, "use_rslora"),
        task_type=task_type,
        rank_pattern=tuple(
            (key, _rank(f"rank_pattern.{key}", value, max_rank))
            for key, value in _pattern(config, "rank_pattern").items()
        ),
        alpha_pattern=tuple(
            (key, _alpha(f"alpha_pattern.{key}", value)) for key, value in _pattern(config, "alpha_pattern").items()
        ),
    )


def rebuilt_config(fields: LoraFields, module_ranks: Mapping[str, int]) -> dict[str, Any]:
    """The config PEFT gets, for weights holding these modules (full path -> the rank of their matrices).

    Its ``target_modules`` is the explicit list of the modules the weights hold, so PEFT wraps nothing else;
    each module's rank and alpha are written against its escaped full path, so no pattern of the tenant's is
    read; and the weights must be what the config says (each module targeted, of the rank it gives)."""
    if not module_ranks:
        raise _refused("target_modules", "names no module the weights hold a LoRA matrix pair for")
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for module, rank in sorted(module_ranks.items()):
        if not fields.targets(module):
            raise _refused("target_modules", f"does not name module {module!r}, which the weights adapt")
        if rank != fields.rank_for(module):
            field = "rank_pattern" if fields.rank_for(module) != fields.rank else "r"
            raise _refused(
                field, f"gives module {module!r} the rank {fields.rank_for(module)}, but its matrices have rank {rank}"
            )
        if rank != fields.rank:
            rank_pattern[re.escape(module)] = rank
        if fields.alpha_for(module) != fields.alpha:
            alpha_pattern[re.escape(module)] = fields.alpha_for(module)
    return {
        "peft_type": "LORA",
        "task_type": fields.task_type,
        "r": fields.rank,
        "lora_alpha": fields.alpha,
        "lora_dropout": fields.dropout,
        "target_modules": sorted(module_ranks),
        "bias": "none",
        "fan_in_fan_out": fields.fan_in_fan_out,
        "use_rslora": fields.use_rslora,
        "init_lora_weights": True,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "inference_mode": True,
    }


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


def _rank(field: str, value: Any, max_rank: int | None) -> int:
    if type(value) is not int or value < 1:
        raise _refused(field, f"must be a positive whole number (a rank), not {_shown(value)}")
    if max_rank is not None and value > max_rank:
        raise _refused(field, f"is {value}, over the highest rank served here ({max_rank})")
    return value


def _alpha(field: str, value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 < value <= MAX_ALPHA:
        raise _refused(field, f"must be a number above 0 and at most {MAX_ALPHA:g}, not {_shown(value)}")
    return float(value)


def _dropout(value: Any) -> float:
    if type(value) not in (int, float) or not 0 <= value < 1:
        raise _refused("lora_dropout", f"must be a number from 0 to below 1, not {_shown(value)}")
    return float(value)


def _flag(config: Mapping[str, Any], field: str) -> bool:
    value = config.get(field, False)
    if type(value) is not bool:
        raise _refused(field, f"must be true or false, not {_shown(value)}")
    return value


def _target_modules(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _refused(
            "target_modules",
            f"must be a list of module names, not {_shown(value)}: 'all-linear' or a pattern would put LoRA "
            "layers on modules the weights do not hold",
        )
    for name in value:
        if not isinstance(name, str) or not _MODULE_NAME.match(name) or len(name) > 300:
            raise _refused("target_modules", f"holds {_shown(name)}, which is not a module name")
    return tuple(value)


def _pattern(config: Mapping[str, Any], field: str) -> dict[str, Any]:
    value = config.get(field)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refused(field, f"must be an object of module name to number, not {_shown(value)}")
    for key in value:
        if not _MODULE_NAME.match(key) or len(key) > 300:
            raise _refused(field, f"has the key {_shown(key)}, which is not a module name (patterns are not taken)")
    return value
