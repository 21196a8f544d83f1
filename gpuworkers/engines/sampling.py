"""OpenAI's request fields for text generation, checked and mapped to vLLM's ``SamplingParams``.

Pure functions, importable where neither vLLM nor torch is: the portal checks a batch's lines with them
before anything runs, the vllm engine builds each prompt's ``SamplingParams`` from them, and the slot gives
each record that samples under a job's seed a seed of its own (`record_seed`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tasks.shared.config import (
    MAX_JSON_SCHEMA_BYTES,
    MAX_JSON_SCHEMA_DEPTH,
    MAX_JSON_SCHEMA_PROPERTIES,
    MAX_N,
    MAX_OUTPUT_TOKENS,
)

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's limit, and vLLM's default one)."""

SAMPLING_FIELDS = frozenset(
    {
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "repetition_penalty",
        "stop",
        "logprobs",
        "top_logprobs",
        "logit_bias",
    }
)
"""The request fields `sampling_kwargs` reads."""

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ParamError(ValueError):
    """A request param the engine cannot honour, naming the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class SchemaRefused(ParamError):
    """A JSON schema a shared slot does not compile (`check_schema_bounds`): over this platform's bounds, or
    referring to another document."""


def sampling_kwargs(params: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments from OpenAI-style request params.

    Read, with OpenAI's ranges: ``max_tokens`` (or ``max_completion_tokens``, which wins), ``temperature``,
    ``top_p``, ``n``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
    ``logprobs`` (chat: true, with ``top_logprobs`` alternatives; completions: the number of
    alternatives), and vLLM's ``top_k`` and ``repetition_penalty``. Other keys are not read here (which
    keys an engine takes at all is `gpuworkers.engines.request_params`' business); a field left out or
    null keeps vLLM's default (``max_tokens`` 16, ``temperature`` 1.0, as OpenAI's).

    Raises `ParamError` naming the field for a value of the wrong type or out of range.
    """
    kwargs: dict[str, Any] = {}
    for name in ("max_completion_tokens", "max_tokens"):
        if params.get(name) is not None:
            kwargs["max_tokens"] = _integer(params, name, minimum=1)
            check_bound(name, kwargs["max_tokens"], MAX_OUTPUT_TOKENS.read(), "BATCHERY_MAX_OUTPUT_TOKENS")
            break
    _put(kwargs, "temperature", _number(params, "temperature", 0, 2))
    _put(kwargs, "top_p", _number(params, "top_p", 0, 1, low_open=True))
    _put(kwargs, "n", _integer(params, "n", minimum=1))
    check_bound("n", kwargs.get("n"), MAX_N.read(), "BATCHERY_MAX_N")
    _put(kwargs, "seed", _integer(params, "seed"))
    _put(kwargs, "presence_penalty", _number(params, "presence_penalty", -2, 2))
    _put(kwargs, "frequency_penalty", _number(params, "frequency_penalty", -2, 2))
    _put(kwargs, "top_k", _integer(params, "top_k", minimum=-1))
    _put(kwargs, "repetition_penalty", _number(params, "repetition_penalty", 0, 2, low_open=True))
    _put(kwargs, "stop", _stop(params.get("stop")))
    _put(kwargs, "logprobs", _logprobs(params))
    _put(kwargs, "logit_bias", _logit_bias(params.get("logit_bias")))
    return kwargs


def greedy_copies(kwargs: dict[str, Any]) -> int:
    """How many identical samples a greedy request (``temperature`` 0) of ``n`` > 1 asks, its ``n`` set to 1 in
    ``kwargs``; 1 for any other request, left as it is.

    OpenAI answers such a request with ``n`` equal choices; vLLM refuses it (``n must be 1 when using greedy
    sampling``). Greedy decoding gives the same sample each time, so one is decoded and copied."""
    copies = kwargs.get("n", 1)
    if copies == 1 or kwargs.get("temperature") != 0:
        return 1
    kwargs["n"] = 1
    return int(copies)


def structured_output(params: Mapping[str, Any]) -> dict[str, Any] | None:
    """What ``response_format`` asks of decoding, as vLLM's structured-output fields; None for plain text.

    ``{"type": "json_object"}`` gives ``{"json_object": True}``; ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}`` gives ``{"json": schema}`` (vLLM's grammar backends always hold the
    output to the schema, so ``strict`` false is served strictly too, which OpenAI allows).
    Raises `ParamError` for a shape OpenAI would refuse.
    """
    response_format = params.get("response_format")
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ParamError("response_format", 'response_format must be an object such as {"type": "json_object"}')
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ParamError(
            "response_format.type", f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, not {kind!r}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise ParamError("response_format.json_schema", "response_format.json_schema must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ParamError("response_format.json_schema.name", "response_format.json_schema.name must be a string")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ParamError(
            "response_format.json_schema.schema", "response_format.json_schema.schema must be a JSON Schema object"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ParamError("response_format.json_schema.strict", "response_format.json_schema.strict must be a boolean")
    check_schema_bounds("response_format.json_schema.schema", schema)
    return {"json": dict(schema)}


_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")
"""JSON Schema's references: one to another document is a URL a grammar backend would resolve."""


def check_schema_bounds(field: str, schema: Any) -> None:
    """Raise `ParamError` naming `field` where a JSON schema is larger than a shared slot compiles, or refers to
    another document (a ``$ref`` that is not ``#…``).

    vLLM compiles each schema into a grammar on the slot, and neither it nor its grammar backends bound the
    time that takes; the schema's size (``BATCHERY_MAX_JSON_SCHEMA_BYTES``), nesting depth
    (``BATCHERY_MAX_JSON_SCHEMA_DEPTH``) and number of properties (``BATCHERY_MAX_JSON_SCHEMA_PROPERTIES``) are
    what that time grows with. Checked at submission and again on the slot before vLLM sees the schema.
    """
    size_limit, depth_limit, properties_limit = (
        MAX_JSON_SCHEMA_BYTES.read(),
        MAX_JSON_SCHEMA_DEPTH.read(),
        MAX_JSON_SCHEMA_PROPERTIES.read(),
    )
    # Walked without recursion, so that a schema nested thousands deep is measured, not a RecursionError.
    properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > depth_limit:
            raise SchemaRefused(
                field,
                f"{field} nests deeper than {depth_limit} levels, this platform's limit "
                "(BATCHERY_MAX_JSON_SCHEMA_DEPTH)",
            )
        if isinstance(value, Mapping):
            for keyword in _REFERENCES:
                reference = value.get(keyword)
                if reference is not None and not (isinstance(reference, str) and reference.startswith("#")):
                    raise SchemaRefused(
                        field,
                        f"{field} holds a {keyword} to {str(reference)[:100]!r}: only references within the "
                        "schema (#/...) are taken, since a slot fetches nothing a request names",
                    )
            named = value.get("properties")
            if isinstance(named, Mapping):
                properties += len(named)
                if properties > properties_limit:
                    raise SchemaRefused(
                        field,
                        f"{field} has more than {properties_limit} properties, this platform's limit "
                        "(BATCHERY_MAX_JSON_SCHEMA_PROPERTIES)",
                    )
            stack.extend((item, depth + 1) for item in value.values() if isinstance(item, Mapping | list))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value if isinstance(item, Mapping | list))
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > size_limit:
        raise SchemaRefused(
            field,
            f"{field} is {size} bytes, over this platform's limit of {size_limit} (BATCHERY_MAX_JSON_SCHEMA_BYTES)",
        )


def is_int(value: Any) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _put(kwargs: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        kwargs[name] = value


def check_bound(name: str, value: int | None, limit: int, setting: str) -> None:
    """Raise `ParamError` when `value` asks for more than this platform's `limit` allows."""
    if value is not None and value > limit:
        raise ParamError(name, f"{name} is {value}, over this platform's limit of {limit} ({setting})")


def _integer(params: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise ParamError(name, f"{name} must be an integer, not {value!r}")
    if minimum is not None and value < minimum:
        raise ParamError(name, f"{name} must be at least {minimum}, not {value}")
    return int(value)


def _number(params: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParamError(name, f"{name} must be a number, not {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ParamError(name, f"{name} must be in {interval}, not {value}")
    return float(value)


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) and item for item in items):
        raise ParamError("stop", f"stop must be a non-empty string or a list of them, not {stop!r}")
    return list(items) or None


def _logprobs(params: Mapping[str, Any]) -> int | None:
    """Alternatives per token to return, from chat's ``logprobs``/``top_logprobs`` or completions' ``logprobs``."""
    logprobs = params.get("logprobs")
    top = _integer(params, "top_logprobs", minimum=0)
    if top is not None and top > MAX_LOGPROBS:
        raise ParamError("top_logprobs", f"top_logprobs must be at most {MAX_LOGPROBS}, not {top}")
    if isinstance(logprobs, bool) or logprobs is None:
        if top is not None and not logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs to be true")
        return (top or 0) if logprobs else None
    if top is not None:
        raise ParamError(
            "top_logprobs", "top_logprobs goes with logprobs: true; an integer logprobs already says how many"
        )
    count = _integer(params, "logprobs", minimum=0)
    if count is not None and count > MAX_LOGPROBS:
        raise ParamError("logprobs", f"logprobs must be at most {MAX_LOGPROBS}, not {count}")
    return count


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ParamError("logit_bias", f"logit_bias must map token ids to biases, not {bias!r}")
    checked: dict[int, float] = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ParamError("logit_bias", f"logit_bias keys must be token ids, not {token!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ParamError("logit_bias", f"logit_bias values must be numbers in [-100, 100], not {value!r}")
        checked[token_id] = float(value)
    return checked or None


SAMPLES_BY_DEFAULT = frozenset({"vllm"})
"""Engines whose ``temperature`` defaults to 1.0 (vLLM's, as OpenAI's); the transformers engine's is 0, greedy."""


def samples(engine: str, params: Mapping[str, Any]) -> bool:
    """Whether a record run by ``engine`` with ``params`` samples (a temperature above 0, or none where the
    engine's default samples). A temperature that is no number is the engine's to refuse: not sampling here."""
    temperature = params.get("temperature")
    if temperature is None:
        return engine in SAMPLES_BY_DEFAULT
    return isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature > 0


def record_seed(seed: int, custom_id: str) -> int:
    """The seed a record samples with under its job's ``seed``: a digest of both, so that what a record draws
    depends on no other record, nor on the shard or micro-batch it runs in; below 2**31, which every
    engine takes."""
    digest = hashlib.sha256(f"{seed}\x00{custom_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF
