"""The ``transformers`` engine: text generation with a Hugging Face causal LM on disk (tasks ``generate``, ``chat``).

Task ``generate`` takes a prompt string; task ``chat`` takes an OpenAI-style list of messages
(``{"role", "content"}``, string content), rendered into a prompt by the tokenizer's chat template with
the assistant's generation prompt. Both give ``{"text", "finish_reason": "stop" | "length", "usage":
{"prompt_tokens", "completion_tokens", "prompt_tokens_details": {"cached_tokens"}}}``, as the vllm engine
does, and ``stop_sequence``, the stop string that ended the text, where one did. Prompts of a micro-batch
that share a long prefix continue its KV cache, computed once (`gpuworkers.engines.prefix_reuse`); each
group, and the other prompts, are sorted by length and cut into sub-batches of ``batch_size`` prompts, so
that each sub-batch pads little; responses come back in input order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from gpuworkers import settings
from gpuworkers.engines.base import ADAPTER_PARAM, EngineLoadError
from gpuworkers.engines.lora import BaseWeightsChanged, LoraAdapters
from gpuworkers.engines.messages import require_messages
from gpuworkers.engines.prefix_reuse import PrefixKV, PrefixPlan, PrefixReuse, no_prefixes, prefixed_inputs, sub_batches
from gpuworkers.engines.sampling import ParamError, check_bound, is_int, structured_output
from gpuworkers.engines.torch_memory import TorchModelHolder, module_bytes
from gpuworkers.sources import forbid_hub_downloads, resolve_model_source
from gpuworkers.spec import AdapterSpec, ModelSpec
from tasks.shared.config import MAX_OUTPUT_TOKENS

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

TASKS = ("generate", "chat")
"""The model tasks this engine runs."""

_LOAD_PARAMS = frozenset({"dtype"})
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class GenerationParams:
    """The parameters of one `run_batch` call, checked once for the whole micro-batch."""

    FIELDS: ClassVar[frozenset[str]] = frozenset(
        {
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "batch_size",
            "n",
            "logprobs",
            "response_format",
            "truncate",
            "prefix_reuse",
        }
    )
    """The request fields this engine reads; ``n``, ``logprobs`` and ``response_format`` only at the values
    that ask for nothing more than plain decoding."""

    max_tokens: int
    """Most tokens to generate per prompt."""
    temperature: float
    """0 decodes greedily; above 0 samples."""
    top_p: float
    """Nucleus sampling mass; 1.0 keeps every token. Used only when sampling."""
    seed: int | None
    """Seeds torch's generator before each prompt, for repeatable sampling whatever the micro-batch holds."""
    stop: tuple[str, ...]
    """The text ends before the first of these strings it contains."""
    batch_size: int
    """Prompts per `generate` call."""
    truncate: bool = False
    """A prompt too long for the context keeps its last tokens, leaving room for ``max_tokens``; otherwise it
    is refused."""
    prefix_reuse: bool = True
    """Prompts sharing a long prefix have its KV cache computed once (`gpuworkers.engines.prefix_reuse`);
    false computes every prompt whole, as a baseline to measure against."""

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> GenerationParams:
        """Raises `ParamError` naming the field for a value out of range, or one this engine cannot honour."""
        stop = params.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, list | tuple) or not all(isinstance(item, str) and item for item in stop):
            raise ParamError("stop", "stop must be a non-empty string or a list of them")
        _refuse_beyond_plain_decoding(params)
        max_tokens = params.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = params.get("max_tokens")
        temperature, top_p = params.get("temperature"), params.get("top_p")
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ParamError(name, f"{name} must be a number, not {value!r}")
        generation = cls(
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            seed=params.get("seed"),
            stop=tuple(stop),
            batch_size=params.get("batch_size") or 32,
            truncate=params.get("truncate") is True,
            prefix_reuse=params.get("prefix_reuse") is not False,
        )
        for name in ("truncate", "prefix_reuse"):
            if params.get(name) not in (None, True, False):
                raise ParamError(name, f"{name} must be true or false, not {params[name]!r}")
        if not is_int(generation.max_tokens) or generation.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be a positive integer, not {generation.max_tokens!r}")
        check_bound("max_tokens", generation.max_tokens, MAX_OUTPUT_TOKENS.read(), "BATCHERY_MAX_OUTPUT_TOKENS")
        if not 0 <= generation.temperature <= 2:
            raise ParamError("temperature", f"temperature must be in [0, 2], not {generation.temperature}")
        if not 0 < generation.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], not {generation.top_p}")
        if generation.seed is not None and not is_int(generation.seed):
            raise ParamError("seed", f"seed must be an integer, not {generation.seed!r}")
        if not is_int(generation.batch_size) or generation.batch_size < 1:
            raise ParamError("batch_size", f"batch_size must be a positive integer, not {generation.batch_size!r}")
        return generation


def _refuse_beyond_plain_decoding(params: Mapping[str, Any]) -> None:
    """Refuse what only vLLM does: several samples, logprobs, structured output."""
    n = params.get("n")
    if n is not None and n != 1:
        raise ParamError("n", f"n must be 1 on the transformers engine (one sample a request), not {n!r}")
    if params.get("logprobs") not in (None, False) or params.get("top_logprobs") is not None:
        raise ParamError("logprobs", "logprobs are not returned by the transformers engine; leave logprobs out")
    if structured_output(params) is not None:
        raise ParamError(
            "response_format",
            "response_format needs structured output (guided decoding), which the transformers engine does not "
            "have; run the request on a model served by the vllm engine, or leave response_format out",
        )


class TransformersEngine(TorchModelHolder):
    """Generates text from prompts or chats; load once per worker process, then call `run_batch` per micro-batch.

    Inputs of `run_batch`: prompt strings (task ``generate``) or lists of messages (task ``chat``,
    which needs a tokenizer with a chat template). Params, the same for both tasks: ``max_tokens``
    (16; ``max_completion_tokens`` wins), ``temperature`` (0: greedy), ``top_p`` (1.0), ``seed``, ``stop``
    (a string or a list of them), ``batch_size`` (prompts per generate call, 32), ``prefix_reuse`` (true: a
    shared prompt prefix is computed once); see `GenerationParams` for what is refused. A record's LoRA
    adapter (`ADAPTER_PARAM`, set by the slot) runs through `LoraAdapters`: loaded beside the base model on
    first use, switched per call, its prefixes cached apart from the base model's. Load params: ``dtype`` (``float32``,
    ``float16``, ``bfloat16``); by default float16 on CUDA and float32 on CPU, where half precision is
    slow.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        # Any: transformers' annotations of a causal LM (`to`, `generate`) do not type-check as used.
        self._model: Any = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._adapters: LoraAdapters | None = None
        self._prefixes: PrefixReuse | None = None
        self._device = "cpu"

    def load(self, *, device: str) -> None:
        if self.spec.task not in TASKS:
            raise EngineLoadError(f"the transformers engine runs tasks {', '.join(TASKS)}, not {self.spec.task!r}")
        dtype_name = self._dtype_name(device)
        path = resolve_model_source(self.spec.source)
        forbid_hub_downloads()
        settings.apply_torch_threads()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=getattr(torch, dtype_name)
            )
            model.to(device)
        except Exception as exc:
            raise EngineLoadError(f"cannot load {self.spec.name!r} from {path}: {type(exc).__name__}: {exc}") from exc
        if self.spec.task == "chat" and not tokenizer.chat_template:
            raise EngineLoadError(
                f"the tokenizer of {self.spec.name!r} has no chat template, which task 'chat' needs to render messages"
            )
        model.eval()
        self._device = device
        self._adapters = LoraAdapters(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise EngineLoadError(f"the tokenizer of {self.spec.name!r} has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
        if not _eos_token_ids(model, tokenizer):
            raise EngineLoadError(f"{self.spec.name!r} names no end-of-sequence token")
        self._model, self._tokenizer = model, tokenizer
        if settings.prefix_min_tokens() > 0:
            self._prefixes = PrefixReuse(
                model, min_tokens=settings.prefix_min_tokens(), cache_bytes=settings.prefix_cache_bytes()
            )

    def unload(self) -> None:
        self._prefixes = None
        self._adapters = None
        super().unload()

    def _reload(self) -> None:
        """Load the base model again from its source, keeping which adapters were refused."""
        refused = {} if self._adapters is None else self._adapters.refused
        self.unload()
        self.load(device=self._device)
        assert self._adapters is not None  # set by load
        self._adapters.refused.update(refused)

    def shares_prefixes(self, params: Mapping[str, Any]) -> bool:
        """Whether records sharing a prompt prefix are worth putting in one micro-batch (`gpuworkers.batching`)."""
        return self._prefixes is not None and params.get("prefix_reuse") is not False

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        _, tokenizer = self._loaded()
        generation = GenerationParams.from_mapping(params)
        items = list(inputs)
        if not items:
            return []
        token_ids = self._prompt_token_ids(tokenizer, items)
        if generation.truncate:
            token_ids = self._truncated(token_ids, generation.max_tokens)
        self._check_lengths(token_ids, generation.max_tokens)

        import torch

        # Sampling draws the whole sub-batch's tokens from one generator, so a seeded prompt sampled beside
        # others would not give what it gives alone: each such prompt runs alone, right after the seed is set.
        seeded = generation.seed is not None and generation.temperature > 0
        step = 1 if seeded else generation.batch_size
        responses: list[dict[str, Any]] = [{} for _ in items]
        assert self._adapters is not None  # set by load, with the model
        adapter = params.get(ADAPTER_PARAM)
        try:
            with self._adapters.active(adapter) as adapted:
                namespace = "" if adapter is None else AdapterSpec.from_dict(dict(adapter)).fingerprint
                plan = self._prefix_plan(token_ids, generation, adapted, namespace)
                for indices, prefix in sub_batches(plan, token_ids, step):
                    if seeded:
                        torch.manual_seed(generation.seed)
                    batch_responses = self._generate(
                        adapted, tokenizer, [token_ids[i] for i in indices], generation, prefix
                    )
                    for index, response in zip(indices, batch_responses, strict=True):
                        responses[index] = response
        except BaseWeightsChanged:
            # The weights cannot be put back in place: every later record, of any tenant, runs on a fresh copy.
            self._reload()
            raise
        for response, cached in zip(responses, plan.cached_tokens, strict=True):
            response["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return responses

    def _prefix_plan(
        self, token_ids: list[list[int]], generation: GenerationParams, model: Any, namespace: str
    ) -> PrefixPlan:
        if self._prefixes is None or not generation.prefix_reuse:
            return no_prefixes(len(token_ids))
        return self._prefixes.plan(token_ids, model=model, namespace=namespace)

    def memory_bytes(self) -> int:
        return 0 if self._adapters is None else module_bytes(self._adapters.model)

    def loaded_adapters(self) -> list[str]:
        """Fingerprints of the LoRA adapters loaded beside the model (`HoldsAdapters`)."""
        return [] if self._adapters is None else self._adapters.loaded

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """For each prompt, why it and ``max_tokens`` overflow the model's context, or None where they fit."""
        model, tokenizer = self._loaded()
        max_tokens = GenerationParams.from_mapping(params).max_tokens
        context = getattr(model.config, "max_position_embeddings", None)
        if context is None:
            return [None] * len(inputs)
        return [
            _overflow(len(ids), max_tokens, context) if len(ids) + max_tokens > context else None
            for ids in self._prompt_token_ids(tokenizer, list(inputs))
        ]

    def _dtype_name(self, device: str) -> str:
        unknown = set(self.spec.load_params) - _LOAD_PARAMS
        if unknown:
            raise EngineLoadError(
                f"unknown load params for transformers: {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(_LOAD_PARAMS))}"
            )
        default = "float16" if device.startswith("cuda") else "float32"
        dtype_name = self.spec.load_params.get("dtype", default)
        if dtype_name not in _DTYPES:
            raise EngineLoadError(f"dtype {dtype_name!r} is not one of {', '.join(_DTYPES)}")
        return str(dtype_name)

    def _loaded(self) -> tuple[Any, PreTrainedTokenizerBase]:
        if self._model is None or self._tokenizer is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._model, self._tokenizer

    def _prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase, items: list[Any]) -> list[list[int]]:
        if self.spec.task == "chat":
            texts = [_render_chat(tokenizer, require_messages(item, text_content=True)) for item in items]
            # The rendered template already holds the model's special tokens (BOS and the like).
            return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        for prompt in items:
            if not isinstance(prompt, str):
                raise ValueError(f"the prompt must be a string, not {type(prompt).__name__}")
        return tokenizer(items, return_attention_mask=False)["input_ids"]

    def _check_lengths(self, token_ids: list[list[int]], max_tokens: int) -> None:
        # Positions past the model's context index out of its position table, which on CUDA is a
        # device-side assert that poisons the whole process; refuse such a prompt up front.
        context = getattr(self._loaded()[0].config, "max_position_embeddings", None)
        for ids in token_ids:
            if not ids:
                raise ValueError("the prompt is empty")
            if context is not None and len(ids) + max_tokens > context:
                raise ValueError(_overflow(len(ids), max_tokens, context))

    def _truncated(self, token_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        context = getattr(self._loaded()[0].config, "max_position_embeddings", None)
        if context is None:
            return token_ids
        if max_tokens >= context:
            raise ParamError("max_tokens", f"max_tokens={max_tokens} leaves no room in the context of {context} tokens")
        # The end of a prompt is what the model answers; its beginning goes first.
        return [ids[len(ids) + max_tokens - context :] if len(ids) + max_tokens > context else ids for ids in token_ids]

    def _generate(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase,
        token_ids: list[list[int]],
        generation: GenerationParams,
        prefix: PrefixKV | None = None,
    ) -> list[dict[str, Any]]:
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        eos_ids = _eos_token_ids(model, tokenizer)
        # A fresh config rather than the model's own, so that only the job's params steer decoding.
        config = GenerationConfig(
            max_new_tokens=generation.max_tokens,
            do_sample=generation.temperature > 0,
            eos_token_id=sorted(eos_ids),
            pad_token_id=tokenizer.pad_token_id,
        )
        if generation.temperature > 0:
            config.temperature = generation.temperature
            config.top_p = generation.top_p
            config.top_k = 0
        inputs: Mapping[str, Any]
        if prefix is None:
            inputs = tokenizer.pad({"input_ids": token_ids}, padding=True, return_tensors="pt").to(model.device)
        else:
            inputs = prefixed_inputs(prefix, token_ids, pad_id=tokenizer.pad_token_id, model=model)
        prompt_width = inputs["input_ids"].shape[1]
        stopping = StoppingCriteriaList()
        if generation.stop:
            stopping.append(_StopStrings(tokenizer, generation.stop, prompt_width))
        with torch.inference_mode():
            output = model.generate(**inputs, generation_config=config, stopping_criteria=stopping)
        completions = output[:, prompt_width:].tolist()
        return [
            _completion(tokenizer, ids, completion, eos_ids, generation)
            for ids, completion in zip(token_ids, completions, strict=True)
        ]


def _overflow(prompt_tokens: int, max_tokens: int, context: int) -> str:
    return (
        f"the prompt has {prompt_tokens} tokens; with max_tokens={max_tokens} it exceeds the model's context "
        f"of {context} tokens (truncate: true keeps the prompt's last tokens instead)"
    )


class _StopStrings:
    """A stopping criterion: a row is done once its decoded completion holds a stop string.

    Decoding the completion so far, rather than matching token strings, keeps the decision the same
    as the one `_completion` makes afterwards on the text it returns.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], prompt_width: int) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        import torch

        texts = self._tokenizer.batch_decode(input_ids[:, self._prompt_width :], skip_special_tokens=True)
        done = [_first_stop(text, self._stop) is not None for text in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _completion(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[int],
    completion: list[int],
    eos_ids: set[int],
    generation: GenerationParams,
) -> dict[str, Any]:
    # Tokens after the first end-of-sequence token are padding of a row that finished early.
    end = next((i for i, token in enumerate(completion) if token in eos_ids), len(completion))
    generated = completion[:end]
    text = _decode(tokenizer, generated)
    cut = _first_stop(text, generation.stop)
    stop_sequence = None
    if cut is not None:
        # The stop string that ended it, as vLLM's `stop_reason` tells: Anthropic's results name it.
        stop_sequence = next(item for item in generation.stop if text.startswith(item, cut))
        text = text[:cut]
        finish_reason = "stop"
        completion_tokens = _tokens_until_stop(tokenizer, generated, generation.stop)
    elif end < len(completion):
        finish_reason = "stop"
        completion_tokens = end + 1  # the end-of-sequence token was generated too
    else:
        finish_reason = "length"
        completion_tokens = end
    response: dict[str, Any] = {
        "text": text,
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens},
    }
    if stop_sequence is not None:
        response["stop_sequence"] = stop_sequence
    return response


def _first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    positions = [position for position in (text.find(item) for item in stop) if position >= 0]
    return min(positions, default=None)


def _tokens_until_stop(tokenizer: PreTrainedTokenizerBase, generated: list[int], stop: tuple[str, ...]) -> int:
    """The fewest leading tokens of ``generated`` whose text holds a stop string (the tokens generated)."""
    low, high = 1, len(generated)
    while low < high:
        middle = (low + high) // 2
        if _first_stop(_decode(tokenizer, generated[:middle]), stop) is None:
            low = middle + 1
        else:
            high = middle
    return high


def _render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> str:
    """The conversation as the model's prompt text, ending with the assistant's turn to speak."""
    return cast(str, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def _decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    return cast(str, tokenizer.decode(token_ids, skip_special_tokens=True))


def _eos_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return set()
    return {configured} if isinstance(configured, int) else set(configured)
