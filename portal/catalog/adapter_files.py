"""What a LoRA adapter's files must be before the catalog takes them: PEFT's layout, safetensors only,
tensors shaped for the base model, within the size and rank bounds.

`read_config` checks the adapter's ``adapter_config.json`` against what a config may ask
(`gpuworkers.engines.lora_config`, the rules the slot loads by) before anything else of the upload is read;
`adapter_check` reads the header of its ``adapter_model.safetensors`` (never a pickle, never the tensors'
data), and the headers of the base model's safetensors files from its catalog source, and gives the config
to store, rebuilt from the checked fields. Every problem is an `AdapterRefused` naming the file, the field or
the tensor.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import IO, Any

from gpuworkers.engines.lora_config import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    LoraConfigRefused,
    LoraFields,
    lora_fields,
    rebuilt_config,
)

MAX_HEADER_BYTES = 16 * 1024 * 1024
"""The largest safetensors header read: a base model of tens of thousands of tensors has a few MB."""
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_LORA_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class AdapterRefused(Exception):
    """The adapter cannot be registered; the message names the file, field or tensor at fault."""

    def __init__(self, message: str, *, field: str = "files") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class CheckedAdapter:
    rank: int
    weights_bytes: int
    target_modules: tuple[str, ...]
    """The base model's modules the adapter changes, e.g. ``transformer.h.0.attn.c_attn``."""
    config: dict[str, Any]
    """The ``adapter_config.json`` to store: rebuilt from the checked fields (`rebuilt_config`), never the
    upload's own."""


OpenFile = Callable[[str], AbstractContextManager[IO[bytes]]]
"""Opens one file of a model directory (by its name within it) for reading from its start."""


def read_config(raw: bytes, *, max_rank: int) -> LoraFields:
    """The checked fields of the adapter's ``adapter_config.json`` (a PEFT LoRA config), every rank at most
    ``max_rank``."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterRefused(f"{CONFIG_FILE} is {len(raw)} bytes, over the limit of {MAX_CONFIG_BYTES}")
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRefused(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    except RecursionError:
        raise AdapterRefused(f"{CONFIG_FILE} is not valid JSON: it nests too deeply") from None
    if not isinstance(config, dict):
        raise AdapterRefused(f"{CONFIG_FILE} must hold a JSON object")
    try:
        return lora_fields(config, max_rank=max_rank)
    except LoraConfigRefused as exc:
        raise AdapterRefused(exc.message) from None


def safetensors_header(stream: IO[bytes], *, name: str, size: int | None = None) -> dict[str, Any]:
    """The tensors a safetensors file declares (name -> dtype, shape, offsets), read from its header alone.

    With ``size`` (the file's bytes) the header must account for the file exactly: a file with more or
    fewer bytes than its tensors need, or offsets past its end, is refused."""
    prefix = stream.read(8)
    if len(prefix) < 8:
        raise AdapterRefused(f"{name} is not a safetensors file: it is shorter than a header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise AdapterRefused(f"{name} is not a safetensors file: its header claims {length} bytes")
    raw = stream.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise AdapterRefused(f"{name} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise AdapterRefused(f"{name} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for tensor, entry in header.items():
        _check_entry(name, tensor, entry)
        end = max(end, entry["data_offsets"][1])
    if size is not None and size != 8 + length + end:
        raise AdapterRefused(
            f"{name} is {size} bytes, but its header accounts for {8 + length + end}: the file is truncated or padded"
        )
    return header


def _check_entry(name: str, tensor: str, entry: Any) -> None:
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_BYTES:
        raise AdapterRefused(f"{name}: tensor {tensor!r} has no dtype safetensors knows")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise AdapterRefused(f"{name}: tensor {tensor!r} has no valid shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise AdapterRefused(f"{name}: tensor {tensor!r} has no valid data offsets")
    count = 1
    for dim in shape:
        count *= dim
    if not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != count * _DTYPE_BYTES[entry["dtype"]]:
        raise AdapterRefused(f"{name}: tensor {tensor!r} has data offsets that do not fit its shape and dtype")


def base_model_shapes(open_file: OpenFile, files: Iterable[str]) -> dict[str, list[int]]:
    """Every weight's shape in a base model directory holding ``files``, from its safetensors headers.

    Raises `AdapterRefused` when the base model keeps no safetensors weights (its shapes cannot be read)."""
    names = set(files)
    if "model.safetensors.index.json" in names:
        with open_file("model.safetensors.index.json") as stream:
            index = json.loads(stream.read(MAX_HEADER_BYTES))
        weight_files = sorted(set((index.get("weight_map") or {}).values()))
    else:
        weight_files = sorted(name for name in names if name.endswith(".safetensors"))
    if not weight_files:
        raise AdapterRefused(
            "the base model's weights are not in safetensors, so an adapter's shapes cannot be checked against them",
            field="base_model",
        )
    shapes: dict[str, list[int]] = {}
    for weight_file in weight_files:
        with open_file(weight_file) as stream:
            header = safetensors_header(stream, name=f"the base model's {weight_file}")
        shapes.update({tensor: entry["shape"] for tensor, entry in header.items()})
    return shapes


def adapter_check(
    fields: LoraFields,
    header: Mapping[str, Any],
    *,
    weights_bytes: int,
    base_shapes: Mapping[str, list[int]],
    max_bytes: int,
) -> CheckedAdapter:
    """The adapter's rank, targets and config to store once its config and tensors fit each other and the
    base model."""
    if weights_bytes > max_bytes:
        raise AdapterRefused(f"{WEIGHTS_FILE} is {weights_bytes} bytes, over the limit of {max_bytes}")
    pairs: dict[str, dict[str, list[int]]] = {}
    for tensor, entry in header.items():
        match = _LORA_TENSOR.match(tensor)
        if match is None:
            raise AdapterRefused(
                f"{WEIGHTS_FILE}: tensor {tensor!r} is not a LoRA matrix "
                "(base_model.model.<module>.lora_A.weight or lora_B.weight)"
            )
        pairs.setdefault(match["module"], {})[match["part"]] = entry["shape"]
    if not pairs:
        raise AdapterRefused(f"{WEIGHTS_FILE} holds no LoRA matrices")
    for module, parts in sorted(pairs.items()):
        _check_module(module, parts, fields.rank_for(module), base_shapes)
    try:
        config = rebuilt_config(fields, {module: parts["A"][0] for module, parts in pairs.items()})
    except LoraConfigRefused as exc:
        raise AdapterRefused(exc.message) from None
    return CheckedAdapter(
        rank=fields.rank, weights_bytes=weights_bytes, target_modules=tuple(sorted(pairs)), config=config
    )


def _check_module(
    module: str,
    parts: Mapping[str, list[int]],
    expected: int,
    base_shapes: Mapping[str, list[int]],
) -> None:
    if set(parts) != {"A", "B"}:
        missing = "lora_B" if "A" in parts else "lora_A"
        raise AdapterRefused(f"{WEIGHTS_FILE}: module {module!r} has no {missing} matrix")
    a, b = parts["A"], parts["B"]
    if len(a) != 2 or len(b) != 2:
        raise AdapterRefused(f"{WEIGHTS_FILE}: module {module!r}'s LoRA matrices must be two-dimensional")
    if a[0] != expected or b[1] != expected:
        raise AdapterRefused(
            f"{WEIGHTS_FILE}: module {module!r} has matrices of rank {a[0]} and {b[1]}, "
            f"not the rank {expected} its config gives"
        )
    base = _base_weight(module, base_shapes)
    if base is None:
        raise AdapterRefused(f"{WEIGHTS_FILE}: module {module!r} is not a weight of the base model", field="base_model")
    # A linear layer keeps (out, in); GPT-2's Conv1D keeps (in, out) (PEFT's fan_in_fan_out).
    if [b[0], a[1]] != base and [a[1], b[0]] != base:
        raise AdapterRefused(
            f"{WEIGHTS_FILE}: module {module!r} maps {a[1]} features to {b[0]}, but the base model's weight there "
            f"is {base[0]} x {base[1]}",
            field="base_model",
        )


def _base_weight(module: str, base_shapes: Mapping[str, list[int]]) -> list[int] | None:
    """The base weight a LoRA module adapts; a base saved without its top module's prefix matches too."""
    for name in (module, module.partition(".")[2]):
        shape = base_shapes.get(f"{name}.weight")
        if shape is not None and len(shape) == 2:
            return list(shape)
    return None
