"""The ``vllm`` engine: LLM generation, chat and embeddings with vLLM's continuous batching (GPU only).

A whole micro-batch goes to vLLM in one call (`LLM.generate`, `LLM.chat` or `LLM.embed`): vLLM's
scheduler then keeps the GPU full across prompts of different lengths, and hands the outputs back in
input order. The model is tensor-parallel across the slot's GPUs (``CUDA_VISIBLE_DEVICES``).

Responses: tasks ``generate`` and ``chat`` give ``{"text", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens"}}``, plus ``"logprobs"`` when asked for and ``"choices"`` (one per sample) when
``n`` > 1; task ``embed`` gives ``{"embedding": float32 ndarray, "usage": {"prompt_tokens"}}``.

Mapping OpenAI's request fields to vLLM's ``SamplingParams`` (`sampling_kwargs`) and shaping vLLM's
outputs (`completion_response`, `embedding_response`) are pure functions, tested where vLLM cannot
be installed.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError
from gpuworkers.engines.messages import require_messages
from gpuworkers.faults import StickyDeviceError, is_sticky_device_error
from gpuworkers.sources import forbid_hub_downloads, resolve_model_source
from gpuworkers.spec import ModelSpec
from gpuworkers.vllm_metrics import publish_vllm_metrics

logger = logging.getLogger(__name__)

TASKS = ("generate", "chat", "embed")
"""The model tasks this engine runs."""

DEFAULT_GPU_MEMORY_UTILIZATION = settings.CUDA_CACHE_BUDGET_FRACTION
"""vLLM's share of each GPU when the catalog entry does not set ``gpu_memory_utilization``: the warm
cache's whole budget, since vLLM fills what it is given with KV cache."""

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's limit, and vLLM's default one)."""

_RESERVED_LOAD_PARAMS = frozenset({"model", "tensor_parallel_size"})


class VllmEngine:
    """Runs a vLLM model; load once per worker process, then call `run_batch` per micro-batch.

    Params of `run_batch` (generate, chat): OpenAI's request fields, see `sampling_kwargs`; others are
    ignored. Embeddings take no params. Load params: ``dtype`` (``auto``), ``max_model_len`` (the
    model's), ``gpu_memory_utilization`` (0.9), and any other keyword argument of ``vllm.LLM``
    (``enforce_eager``, ``quantization``, ``trust_remote_code``...), passed through as given.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        # Any: vllm is an optional extra, absent where the type checker runs.
        self._vllm: Any = None
        self._llm: Any = None
        self._memory_bytes = 0

    def load(self, *, device: str) -> None:
        if self.spec.task not in TASKS:
            raise EngineLoadError(f"the vllm engine runs tasks {', '.join(TASKS)}, not {self.spec.task!r}")
        if device not in ("cuda", "cuda:0"):
            # vLLM places the model on the first visible GPUs itself; a slot picks them with CUDA_VISIBLE_DEVICES.
            raise EngineLoadError(
                f"the vllm engine runs on the slot's CUDA GPUs (device 'cuda'), not on {device!r}; "
                "choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        vllm = _import_vllm()
        kwargs: dict[str, Any] = {
            "tensor_parallel_size": tensor_parallel_size(self.spec, os.environ.get("CUDA_VISIBLE_DEVICES")),
        }
        if self.spec.task == "embed":
            kwargs.update(embed_runner_kwargs(_parameter_names(vllm.LLM)))
        kwargs.update(engine_kwargs(self.spec.load_params))
        kwargs["model"] = str(resolve_model_source(self.spec.source))
        forbid_hub_downloads()
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as exc:
            if is_sticky_device_error(exc):
                raise StickyDeviceError(f"the device's context broke while loading {self.spec.name!r}") from exc
            raise EngineLoadError(
                f"vllm cannot load {self.spec.name!r} from {kwargs['model']}: {type(exc).__name__}: {exc}"
            ) from exc
        self._vllm, self._llm = vllm, llm
        self._memory_bytes = _device_share_bytes(kwargs["gpu_memory_utilization"])

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        llm = self._loaded()
        items = list(inputs)
        if not items:
            return []
        if self.spec.task == "embed":
            embeddings = [embedding_response(output) for output in llm.embed(_require_texts(items), use_tqdm=False)]
            publish_vllm_metrics(llm)
            return embeddings
        kwargs = sampling_kwargs(params)
        # One SamplingParams for the whole call: vLLM applies a single value to every prompt.
        sampling_params = self._vllm.SamplingParams(**kwargs)
        if self.spec.task == "generate":
            outputs = llm.generate(_require_texts(items), sampling_params=sampling_params, use_tqdm=False)
        else:
            conversations = [require_messages(item) for item in items]
            outputs = llm.chat(conversations, sampling_params=sampling_params, use_tqdm=False)
        responses = [completion_response(output, top_logprobs=kwargs.get("logprobs")) for output in outputs]
        publish_vllm_metrics(llm)
        return responses

    def memory_bytes(self) -> int:
        return self._memory_bytes

    def unload(self) -> None:
        if self._llm is None:
            return
        self._llm = self._vllm = None
        self._memory_bytes = 0
        # vLLM's finalizers stop its engine-core process once the LLM is unreachable; collect it now.
        gc.collect()
        _destroy_distributed_state()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _loaded(self) -> Any:
        if self._llm is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._llm


def tensor_parallel_size(spec: ModelSpec, visible_devices: str | None) -> int:
    """GPUs to split the model over: every GPU of the slot (``CUDA_VISIBLE_DEVICES``), else the spec's count.

    Fewer visible GPUs than the model needs is a load error: vLLM would try to fit it on fewer and fail
    later, or run out of memory.
    """
    if visible_devices is None:
        return spec.gpus_per_replica
    devices = [device for device in visible_devices.split(",") if device.strip()]
    if not devices:
        raise EngineLoadError("CUDA_VISIBLE_DEVICES is empty: this worker has no GPU for the vllm engine")
    if len(devices) < spec.gpus_per_replica:
        raise EngineLoadError(
            f"{spec.name!r} needs {spec.gpus_per_replica} GPUs, but CUDA_VISIBLE_DEVICES={visible_devices!r} "
            f"gives this worker {len(devices)}"
        )
    return len(devices)


def embed_runner_kwargs(llm_parameters: Collection[str]) -> dict[str, Any]:
    """The `vllm.LLM` argument that makes it an embedding model, for the vLLM at hand.

    vLLM 0.10 and later take ``runner="pooling"`` (``task`` was deprecated, then removed); 0.6.4 to 0.9
    take ``task="embed"``; older ones pick the pooling runner from the model's architecture alone.
    """
    if "runner" in llm_parameters:
        return {"runner": "pooling"}
    if "task" in llm_parameters:
        return {"task": "embed"}
    return {}


def engine_kwargs(load_params: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments from a catalog entry's load params, checked where Batchery sets a default."""
    reserved = set(load_params) & _RESERVED_LOAD_PARAMS
    if reserved:
        raise EngineLoadError(
            f"load params {', '.join(sorted(reserved))} are set by the vllm engine (from the model's source "
            "and the slot's GPUs), not by the catalog"
        )
    kwargs = dict(load_params)
    utilization = kwargs.setdefault("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        raise EngineLoadError(f"gpu_memory_utilization must be a number in (0, 1], not {utilization!r}")
    max_model_len = kwargs.setdefault("max_model_len", None)
    if max_model_len is not None and (not _is_int(max_model_len) or max_model_len < 1):
        raise EngineLoadError(f"max_model_len must be a positive integer, not {max_model_len!r}")
    dtype = kwargs.setdefault("dtype", "auto")
    if not isinstance(dtype, str):
        raise EngineLoadError(f"dtype must be a string such as 'auto' or 'bfloat16', not {dtype!r}")
    # vLLM keeps its statistics only when asked; the slot re-exports them on the host's /metrics.
    kwargs.setdefault("disable_log_stats", False)
    return kwargs


def sampling_kwargs(params: Mapping[str, Any]) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments from OpenAI-style request params.

    Read, with OpenAI's ranges: ``max_tokens`` (or ``max_completion_tokens``, which wins), ``temperature``,
    ``top_p``, ``n``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
    ``logprobs`` (chat: true, with ``top_logprobs`` alternatives; completions: the number of
    alternatives), and vLLM's ``top_k`` and ``repetition_penalty``. Any other key is ignored; a field
    left out or null keeps vLLM's default (``max_tokens`` 16, ``temperature`` 1.0, as OpenAI's).

    Raises ValueError naming the field for a value of the wrong type or out of range.
    """
    kwargs: dict[str, Any] = {}
    for name in ("max_completion_tokens", "max_tokens"):
        if params.get(name) is not None:
            kwargs["max_tokens"] = _integer(params, name, minimum=1)
            break
    _put(kwargs, "temperature", _number(params, "temperature", 0, 2))
    _put(kwargs, "top_p", _number(params, "top_p", 0, 1, low_open=True))
    _put(kwargs, "n", _integer(params, "n", minimum=1))
    _put(kwargs, "seed", _integer(params, "seed"))
    _put(kwargs, "presence_penalty", _number(params, "presence_penalty", -2, 2))
    _put(kwargs, "frequency_penalty", _number(params, "frequency_penalty", -2, 2))
    _put(kwargs, "top_k", _integer(params, "top_k", minimum=-1))
    _put(kwargs, "repetition_penalty", _number(params, "repetition_penalty", 0, 2, low_open=True))
    _put(kwargs, "stop", _stop(params.get("stop")))
    _put(kwargs, "logprobs", _logprobs(params))
    _put(kwargs, "logit_bias", _logit_bias(params.get("logit_bias")))
    return kwargs


def completion_response(output: Any, *, top_logprobs: int | None = None) -> dict[str, Any]:
    """The response for one prompt from vLLM's ``RequestOutput`` (``prompt_token_ids``, ``outputs``).

    The first sample is the response's ``text`` and ``finish_reason``; with more than one, every sample
    is in ``choices`` too, and ``completion_tokens`` counts the tokens of all of them, as OpenAI does.
    ``top_logprobs``, the number of alternatives asked per token, adds ``logprobs`` to each sample.
    """
    samples = list(output.outputs)
    if not samples:
        raise ValueError("vllm returned no completion for the prompt")
    choices = [_choice(sample, top_logprobs) for sample in samples]
    response = dict(choices[0])
    del response["index"]
    response["usage"] = {
        "prompt_tokens": len(output.prompt_token_ids or ()),
        "completion_tokens": sum(len(sample.token_ids) for sample in samples),
    }
    if len(choices) > 1:
        response["choices"] = choices
    return response


def embedding_response(output: Any) -> dict[str, Any]:
    """The response for one input from vLLM's ``EmbeddingRequestOutput`` (``prompt_token_ids``,
    ``outputs.embedding``)."""
    # float32 ndarray, as the sentence_transformers engine gives: orjson writes it directly and compactly.
    return {
        "embedding": np.asarray(output.outputs.embedding, dtype=np.float32),
        "usage": {"prompt_tokens": len(output.prompt_token_ids or ())},
    }


def _choice(sample: Any, top_logprobs: int | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": sample.index, "text": sample.text, "finish_reason": sample.finish_reason}
    if top_logprobs is not None and sample.logprobs is not None:
        choice["logprobs"] = {"content": _logprob_content(sample.token_ids, sample.logprobs, top_logprobs)}
    return choice


def _logprob_content(token_ids: Sequence[int], positions: Sequence[Any], top: int) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content``: per generated token, its logprob and the ``top`` likeliest tokens.

    Each position of vLLM's logprobs maps token ids to ``Logprob`` (``logprob``, ``decoded_token``), for
    the sampled token and the top alternatives.
    """
    content = []
    # Not strict: a stop string can cut the text, never the token lists, but a length mismatch is not
    # worth failing a finished record over.
    for token_id, position in zip(token_ids, positions, strict=False):
        entries = dict(position or {})
        chosen = entries.get(token_id)
        likeliest = sorted(entries.values(), key=lambda entry: entry.logprob, reverse=True)[:top]
        content.append(
            {
                "token": _token_text(chosen),
                "logprob": None if chosen is None else float(chosen.logprob),
                "top_logprobs": [{"token": _token_text(entry), "logprob": float(entry.logprob)} for entry in likeliest],
            }
        )
    return content


def _token_text(entry: Any) -> str:
    text = None if entry is None else entry.decoded_token
    return text if isinstance(text, str) else ""


def _put(kwargs: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        kwargs[name] = value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(params: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {value}")
    return int(value)


def _number(params: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = params.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, not {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}, not {value}")
    return float(value)


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) and item for item in items):
        raise ValueError(f"stop must be a non-empty string or a list of them, not {stop!r}")
    return list(items) or None


def _logprobs(params: Mapping[str, Any]) -> int | None:
    """Alternatives per token to return, from chat's ``logprobs``/``top_logprobs`` or completions' ``logprobs``."""
    logprobs = params.get("logprobs")
    top = _integer(params, "top_logprobs", minimum=0)
    if top is not None and top > MAX_LOGPROBS:
        raise ValueError(f"top_logprobs must be at most {MAX_LOGPROBS}, not {top}")
    if isinstance(logprobs, bool) or logprobs is None:
        if top is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return (top or 0) if logprobs else None
    if top is not None:
        raise ValueError("top_logprobs goes with logprobs: true; an integer logprobs already says how many")
    count = _integer(params, "logprobs", minimum=0)
    if count is not None and count > MAX_LOGPROBS:
        raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, not {count}")
    return count


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to biases, not {bias!r}")
    checked: dict[int, float] = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, not {token!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], not {value!r}")
        checked[token_id] = float(value)
    return checked or None


def _require_texts(inputs: list[Any]) -> list[str]:
    # No position in the messages: a failing micro-batch is run again record by record, and the
    # message a record ends up with comes from a batch of one.
    for text in inputs:
        if not isinstance(text, str):
            raise ValueError(f"the input must be a string, not {type(text).__name__}")
        if not text:
            raise ValueError("the input is an empty string")
    return inputs


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise EngineLoadError(
            f"the vllm extra is not installed (pip install 'batchery[vllm]' on a GPU host): {exc}"
        ) from exc
    except Exception as exc:
        # vllm imports torch's CUDA extensions at import time; a driver or build mismatch shows here.
        raise EngineLoadError(f"cannot import vllm: {type(exc).__name__}: {exc}") from exc
    return vllm


def _parameter_names(callable_: Any) -> set[str]:
    try:
        return set(inspect.signature(callable_).parameters)
    except (TypeError, ValueError):
        return set()


def _device_share_bytes(utilization: float) -> int:
    """vLLM's share of one of the slot's GPUs, best effort (0 when torch cannot tell).

    One GPU's share, not the sum over the slot: the warm cache's budget is one device's memory, and
    vLLM takes the same share of each GPU it is split over.
    """
    import torch

    try:
        if not torch.cuda.is_available():
            return 0
        total = max(torch.cuda.get_device_properties(index).total_memory for index in range(torch.cuda.device_count()))
    except RuntimeError:
        return 0
    return int(utilization * total)


def _destroy_distributed_state() -> None:
    """vLLM's own teardown of its distributed state (``vllm.distributed``), guarded for versions that lack it."""
    try:
        from vllm import distributed
    except ImportError:
        return
    # Older vLLMs lack cleanup_dist_env_and_memory but have the two steps it wraps.
    names = ["cleanup_dist_env_and_memory"]
    if not hasattr(distributed, names[0]):
        names = ["destroy_model_parallel", "destroy_distributed_environment"]
    steps = [getattr(distributed, name, None) for name in names]
    for step in steps:
        if not callable(step):
            continue
        try:
            step()
        except Exception:
            # The model is already unreachable; a failed teardown must not fail the load that evicted it.
            logger.warning("vllm's %s failed after unloading a model", step.__name__, exc_info=True)
