"""The ``vllm`` engine: LLM generation, chat and embeddings with vLLM's continuous batching.

A micro-batch's prompts join vLLM's queue at once (`submit_requests`: `LLM.enqueue`, `LLM.enqueue_chat`), and
the engine is stepped until they have finished (`gpuworkers.engines.vllm_feed`): the slot submits the next
micro-batch before it reads this one's outputs, so vLLM's scheduler keeps the device full across prompts of
different lengths and across micro-batches. Embeddings go in one call (`LLM.embed`). The model is
tensor-parallel across the slot's GPUs (``CUDA_VISIBLE_DEVICES``); on a ``cpu`` slot, vLLM's CPU build runs it in
the slot's process (`gpuworkers.engines.vllm_platform`).

Responses: tasks ``generate`` and ``chat`` give ``{"text", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens", "prompt_tokens_details": {"cached_tokens"}}}`` (the prompt tokens vLLM's automatic
prefix caching served, which generation keeps on unless the catalog's load params say otherwise), plus
``"logprobs"`` when asked for, ``"stop_sequence"`` where a stop string ended the text, and ``"choices"``
(one per sample) when ``n`` > 1; task ``embed`` gives ``{"embedding": float32 ndarray, "usage":
{"prompt_tokens"}}``.

Mapping OpenAI's request fields to vLLM's ``SamplingParams`` (`sampling_kwargs`) and shaping vLLM's
outputs (`gpuworkers.engines.vllm_outputs`) are pure functions, tested where vLLM cannot be installed.
A response format's JSON schema compiles within a bound before vLLM sees it (`grammar_gate`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from gpuworkers.engines import vllm_platform
from gpuworkers.engines.base import (
    ADAPTER_PARAM,
    Answered,
    EngineLoadError,
    Submitted,
    over_limit,
    require_embedding_inputs,
)
from gpuworkers.engines.grammar_gate import GrammarGate
from gpuworkers.engines.media import confine_media_fetches, require_fetch_free
from gpuworkers.engines.messages import require_messages
from gpuworkers.engines.sampling import greedy_copies, sampling_kwargs
from gpuworkers.engines.tools import ToolCalls, reply_format, tool_calls, tools_key
from gpuworkers.engines.vllm_feed import Occupancy, VllmFeed
from gpuworkers.engines.vllm_load import (
    destroy_distributed_state,
    device_share_bytes,
    embed_runner_kwargs,
    engine_kwargs,
    import_vllm,
    parameter_names,
    tensor_parallel_size,
)
from gpuworkers.engines.vllm_lora import VllmLoras
from gpuworkers.engines.vllm_outputs import completion_response, embedding_response
from gpuworkers.engines.vllm_tools import (
    auto_request,
    read_auto_calls,
    sampling_changes,
    tool_parser,
    tool_parser_class,
)
from gpuworkers.faults import StickyDeviceError, is_sticky_device_error
from gpuworkers.sources import forbid_hub_downloads, resolve_model_source
from gpuworkers.spec import ModelSpec
from gpuworkers.vllm_metrics import publish_vllm_metrics

logger = logging.getLogger(__name__)

TASKS = ("generate", "chat", "embed")
"""The model tasks this engine runs."""

DEFAULT_MAX_TOKENS = 16
"""``SamplingParams``' own ``max_tokens`` (and OpenAI's completions default), used when a request gives none."""


class VllmEngine:
    """Runs a vLLM model; load once per worker process, then call `run_batch` per micro-batch.

    Params of `run_batch` (generate, chat): OpenAI's request fields, see `sampling_kwargs`,
    ``response_format`` (`structured_output`), and for chat ``tools`` with any ``tool_choice``
    (`gpuworkers.engines.tools`; ``auto`` needs a tool parser); `run_requests` takes them per prompt.
    Embeddings take ``truncate`` (an input longer than ``max_model_len`` is cut to its first tokens instead of
    refused by `too_long`). Load params: ``dtype`` (``auto``), ``max_model_len`` (the
    model's), ``gpu_memory_utilization`` (0.9), ``tool_call_parser`` (the name of vLLM's tool parser for the
    model's family, for ``tool_choice`` ``auto``; none by default), and any other keyword argument of
    ``vllm.LLM`` (``enforce_eager``, ``quantization``, ``trust_remote_code``...), passed through as given.
    With ``enable_lora``, a record's adapter (`ADAPTER_PARAM`) goes to vLLM as a ``LoRARequest`` beside its
    prompt (``max_loras`` defaults to ``BATCHERY_MAX_LORAS``, ``max_lora_rank`` to `DEFAULT_MAX_LORA_RANK`).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        # Any: vllm is an optional extra, absent where the type checker runs.
        self._vllm: Any = None
        self._llm: Any = None
        self._feed: VllmFeed | None = None
        self._tool_parser: Any = None
        self._tool_parser_name: str | None = None
        self._memory_bytes = 0
        self._loras = VllmLoras(spec.name, spec.load_params)
        self._grammars: GrammarGate | None = None
        self._backend: str | None = None
        self._restore_torch_threads: Callable[[], None] = _nothing

    def load(self, *, device: str) -> None:
        if self.spec.task not in TASKS:
            raise EngineLoadError(f"the vllm engine runs tasks {', '.join(TASKS)}, not {self.spec.task!r}")
        vllm = import_vllm()
        self._backend = vllm_platform.backend()
        vllm_platform.check_device(self._backend, device)
        on_cpu = self._backend == "cpu"
        kwargs: dict[str, Any] = {
            "tensor_parallel_size": 1
            if on_cpu
            else tensor_parallel_size(self.spec, os.environ.get("CUDA_VISIBLE_DEVICES")),
        }
        if on_cpu:
            kwargs.update(vllm_platform.cpu_kwargs(self.spec.load_params))
        if self.spec.task == "embed":
            kwargs.update(embed_runner_kwargs(parameter_names(vllm.LLM)))
        else:
            # vLLM's default (V1) already, said here so that no version's default turns it off: records sharing
            # a system prompt or few-shot preamble have it computed once. A catalog entry may still say false.
            kwargs["enable_prefix_caching"] = True
        kwargs.update(engine_kwargs(self.spec.load_params))
        kwargs.update(confine_media_fetches(vllm))
        kwargs["model"] = str(resolve_model_source(self.spec.source))
        # Found before the model loads: a name vLLM does not know fails at once, holding no GPU memory.
        parser_name = self.spec.load_params.get("tool_call_parser")
        parser_class = None if parser_name is None else tool_parser_class(parser_name)
        forbid_hub_downloads()
        if on_cpu:
            self._restore_torch_threads = vllm_platform.torch_threads_setter_keeper()
        try:
            llm = vllm.LLM(**kwargs)
        except Exception as exc:
            self._restore_torch_threads()
            if is_sticky_device_error(exc):
                raise StickyDeviceError(f"the device's context broke while loading {self.spec.name!r}") from exc
            raise EngineLoadError(
                f"vllm cannot load {self.spec.name!r} from {kwargs['model']}: {type(exc).__name__}: {exc}"
            ) from exc
        self._vllm, self._llm, self._feed = vllm, llm, VllmFeed(llm)
        try:
            self._tool_parser = None if parser_class is None else tool_parser(parser_class, llm.get_tokenizer())
        except Exception:
            # The engine is up: tear it down as an unload would, or its distributed state outlives it and
            # breaks the next model this process loads.
            del llm
            self.unload()
            raise
        self._tool_parser_name = parser_name
        self._grammars = GrammarGate(tokenizer_path=kwargs.get("tokenizer") or kwargs["model"])
        self._memory_bytes = (
            int(kwargs["kv_cache_memory_bytes"]) if on_cpu else device_share_bytes(kwargs["gpu_memory_utilization"])
        )

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        return self.run_requests(inputs, [params] * len(inputs))

    def run_requests(self, inputs: Sequence[Any], params: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Run a micro-batch whose prompts each have their own params: `submit_requests`, then its result."""
        return self.submit_requests(inputs, params).result()

    def submit_requests(self, inputs: Sequence[Any], params: Sequence[Mapping[str, Any]]) -> Submitted:
        """Add a micro-batch's prompts to the engine's queue, each with its own ``SamplingParams`` (prompts of
        different ``max_tokens``, seeds or response formats share the continuous batch), and return at once
        (`Pipelined`). Embeddings run here and now: vLLM queues generation requests only."""
        llm = self._loaded()
        items = list(inputs)
        if not items:
            return Answered([])
        if self.spec.task == "embed":
            return Answered(self._embed(llm, items, params))
        requests = self._requests(items, params)
        ids = self._enqueue(requests)
        return _Queued(self, ids, requests)

    def _embed(self, llm: Any, items: list[Any], params: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        tokenizer = llm.get_tokenizer()
        cut = [own.get("truncate") is True for own in params]
        limit = int(llm.llm_engine.model_config.max_model_len) if any(cut) else None
        prompts = [
            _embedding_prompt(item, tokenizer, limit if truncate else None)
            for item, truncate in zip(require_embedding_inputs(items, len(tokenizer)), cut, strict=True)
        ]
        embeddings = [embedding_response(output) for output in llm.embed(prompts, use_tqdm=False)]
        publish_vllm_metrics(llm)
        return embeddings

    def _requests(self, items: list[Any], params: Sequence[Mapping[str, Any]]) -> _Requests:
        """The micro-batch as vLLM takes it: each prompt's ``SamplingParams``, adapter and tools."""
        kwargs = [sampling_kwargs(own) for own in params]
        copies = [greedy_copies(own) for own in kwargs]
        chat = self.spec.task == "chat"
        calls = [tool_calls(own, tool_parser=self._tool_parser_name) if chat else None for own in params]
        conversations = [require_fetch_free(require_messages(item)) for item in items] if chat else []
        # tool_choice auto: the request the model's tool parser reads the reply against, one per prompt.
        auto: list[Any] = [None] * len(items)
        for index, call in enumerate(calls):
            if call is not None and call.parser is not None:
                auto[index] = auto_request(
                    self._tool_parser, model=self.spec.name, messages=conversations[index], tools=call.tools
                )
        sampling_params = [
            self._sampling_params(
                {**own_kwargs, **(sampling_changes(request) if request is not None else {})}, reply_format(own, call)
            )
            for own_kwargs, own, call, request in zip(kwargs, params, calls, auto, strict=True)
        ]
        loras = [self._loras.request(own.get(ADAPTER_PARAM)) for own in params]
        return _Requests(
            prompts=conversations if chat else _require_texts(items),
            sampling_params=sampling_params,
            loras=loras if any(request is not None for request in loras) else None,
            calls=calls,
            auto=auto,
            kwargs=kwargs,
            copies=copies,
        )

    def _enqueue(self, requests: _Requests) -> list[str]:
        """Add the requests to vLLM's queue; return their ids in input order. A chat micro-batch goes in as one
        call per distinct list of tools, since the chat template renders one list for all the conversations of a
        call."""
        feed = self._loaded_feed()
        if self.spec.task == "generate":
            lora = {} if requests.loras is None else {"lora_request": requests.loras}
            return feed.add(
                lambda llm: llm.enqueue(
                    requests.prompts, sampling_params=requests.sampling_params, use_tqdm=False, **lora
                )
            )
        groups: dict[str, list[int]] = {}
        for index, call in enumerate(requests.calls):
            groups.setdefault(tools_key(call.tools if call else None), []).append(index)
        ids: list[str] = [""] * len(requests.prompts)
        added: list[str] = []
        try:
            for indices in groups.values():
                call = requests.calls[indices[0]]
                extra: dict[str, Any] = {"tools": list(call.tools)} if call is not None else {}
                if requests.loras is not None:
                    extra["lora_request"] = [requests.loras[index] for index in indices]
                group = feed.add(
                    partial(
                        _enqueue_chat,
                        [requests.prompts[index] for index in indices],
                        [requests.sampling_params[index] for index in indices],
                        extra,
                    )
                )
                added.extend(group)
                for index, request_id in zip(indices, group, strict=True):
                    ids[index] = request_id
        except BaseException:
            feed.abort(added)
            raise
        return ids

    def _responses(self, requests: _Requests, outputs: list[Any]) -> list[dict[str, Any]]:
        """vLLM's outputs of a micro-batch as responses: usage, samples, tool calls read back."""
        shaped = [
            completion_response(output, top_logprobs=own_kwargs.get("logprobs"), copies=own_copies)
            for output, own_kwargs, own_copies in zip(outputs, requests.kwargs, requests.copies, strict=True)
        ]
        responses = [
            self._with_tool_calls(response, call, request)
            for response, call, request in zip(shaped, requests.calls, requests.auto, strict=True)
        ]
        publish_vllm_metrics(self._loaded())
        return responses

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """For each input, why it is over the model's ``max_model_len``, or None where it fits.

        A prompt must leave room for ``max_tokens``, as vLLM's OpenAI server asks; without this check vLLM
        would refuse the whole micro-batch for one long prompt.
        """
        llm = self._loaded()
        limit = int(llm.llm_engine.model_config.max_model_len)
        tokenizer = llm.get_tokenizer()
        if self.spec.task == "embed":
            counts = [
                len(tokenizer(item)["input_ids"]) if isinstance(item, str) else len(item)
                for item in require_embedding_inputs(list(inputs), len(tokenizer))
            ]
            return over_limit(counts, limit)
        max_tokens = sampling_kwargs(params).get("max_tokens", DEFAULT_MAX_TOKENS)
        if self.spec.task == "generate":
            texts = _require_texts(list(inputs))
            counts = [len(tokenizer(text)["input_ids"]) for text in texts]
        else:
            rendered = [
                tokenizer.apply_chat_template(require_messages(item), add_generation_prompt=True, tokenize=False)
                for item in inputs
            ]
            # The rendered template already holds the model's special tokens.
            counts = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
        return [
            f"the prompt has {count} tokens; with max_tokens={max_tokens} it exceeds the model's context "
            f"of {limit} tokens"
            if count + max_tokens > limit
            else None
            for count in counts
        ]

    def _sampling_params(self, kwargs: dict[str, Any], structured: dict[str, Any] | None) -> Any:
        if structured is None:
            return self._vllm.SamplingParams(**kwargs)
        if self._grammars is not None and "json" in structured:
            self._grammars.check("response_format", structured["json"])
        params = self._vllm.sampling_params.StructuredOutputsParams(**structured)
        return self._vllm.SamplingParams(**kwargs, structured_outputs=params)

    def _with_tool_calls(self, response: dict[str, Any], calls: ToolCalls | None, request: Any) -> dict[str, Any]:
        """Each sample's reply read back as tool calls (``tool_calls``, finish_reason ``tool_calls``): by the
        model's tool parser for ``auto``, as the JSON it was held to otherwise, where a reply cut before its
        JSON ended keeps its text and finish_reason ``length``."""
        if calls is None:
            return response
        for sample in [response, *response.get("choices", ())]:
            if request is not None:
                read_auto_calls(sample, self._tool_parser, request)
            elif parsed := calls.calls(sample["text"]):
                sample.update(text="", tool_calls=parsed, finish_reason="tool_calls")
        return response

    def memory_bytes(self) -> int:
        return self._memory_bytes

    def process_state(self) -> str | None:
        """`SharesProcessState`: the CPU build's engines all live in the slot's process and share its distributed
        state, which vLLM's shutdown of any of them tears down; a GPU build's each live in processes of their own."""
        try:
            on_cpu = vllm_platform.backend() == "cpu"
        except Exception:
            return None  # no vLLM to import: load() says why
        return "vllm-in-process" if on_cpu else None

    def loaded_adapters(self) -> list[str]:
        """Fingerprints of the LoRA adapters given to vLLM in this process (`HoldsAdapters`)."""
        return self._loras.loaded

    def unload(self) -> None:
        if self._llm is None:
            return
        llm = self._llm
        self._llm = self._vllm = self._feed = self._tool_parser = self._tool_parser_name = None
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None
        self._memory_bytes = 0
        # vLLM's own shutdown, now: its finalizers run only once the engine is collected, which its gc.freeze()
        # puts off until another engine's shutdown, which would tear down the state that one relies on.
        shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()
        if self._backend != "cpu":
            # In the CPU build's process, vLLM's shutdown has just done it.
            destroy_distributed_state()
        self._restore_torch_threads()
        self._restore_torch_threads = _nothing
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _loaded(self) -> Any:
        if self._llm is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._llm

    def _loaded_feed(self) -> VllmFeed:
        self._loaded()
        assert self._feed is not None
        return self._feed

    @property
    def occupancy(self) -> Occupancy:
        """What vLLM's engine held at each step this engine took (`VllmFeed.occupancy`)."""
        return self._loaded_feed().occupancy


def _nothing() -> None:
    return None


def _enqueue_chat(conversations: list[Any], sampling_params: list[Any], extra: dict[str, Any], llm: Any) -> list[str]:
    return list(llm.enqueue_chat(conversations, sampling_params=sampling_params, use_tqdm=False, **extra))


@dataclass(frozen=True)
class _Requests:
    """A micro-batch as vLLM takes it (`VllmEngine._requests`), kept to read its outputs back."""

    prompts: list[Any]
    """Texts (generate) or conversations (chat)."""
    sampling_params: list[Any]
    loras: list[Any] | None
    """Each prompt's ``LoRARequest`` (None for the base model), or None where no prompt names an adapter."""
    calls: list[ToolCalls | None]
    auto: list[Any]
    """For ``tool_choice`` auto, the request the tool parser reads each reply against."""
    kwargs: list[dict[str, Any]]
    """Each prompt's ``SamplingParams`` fields."""
    copies: list[int]
    """Each prompt's greedy copies (`greedy_copies`)."""


class _Queued:
    """A micro-batch in vLLM's queue (`Submitted`)."""

    def __init__(self, engine: VllmEngine, ids: list[str], requests: _Requests) -> None:
        self._engine, self._ids, self._requests = engine, ids, requests

    def result(self) -> list[dict[str, Any]]:
        return self._engine._responses(self._requests, self._engine._loaded_feed().wait(self._ids))

    def cancel(self) -> None:
        if self._engine._feed is not None:
            self._engine._feed.abort(self._ids)


def _embedding_prompt(item: str | list[int], tokenizer: Any, truncate_at: int | None) -> Any:
    """One input as vLLM embeds it: a text as given, a token array as a TokensPrompt (the model's ids, taken as
    given). With ``truncate``, its first `truncate_at` tokens, as sentence-transformers cuts (the tokenizer
    keeps the special tokens around them); vLLM's own ``truncate_prompt_tokens`` would keep the last ones."""
    if truncate_at is None:
        return item if isinstance(item, str) else {"prompt_token_ids": item}
    if isinstance(item, str):
        return {"prompt_token_ids": tokenizer(item, truncation=True, max_length=truncate_at)["input_ids"]}
    return {"prompt_token_ids": item[:truncate_at]}


def _require_texts(inputs: list[Any]) -> list[str]:
    # No position in the messages: a failing micro-batch is run again record by record, and the
    # message a record ends up with comes from a batch of one.
    for text in inputs:
        if not isinstance(text, str):
            raise ValueError(f"the input must be a string, not {type(text).__name__}")
        if not text:
            raise ValueError("the input is an empty string")
    return inputs
