"""The ``sentence_transformers`` engine: text embeddings with a SentenceTransformer model on disk.

The bundled default model, ``all-MiniLM-L6-v2``, runs here. Each response is
``{"embedding": float32 ndarray, "usage": {"prompt_tokens": n}}``, where n counts the tokens the model
read for that input (special tokens included, truncation at ``max_seq_length`` applied). Counting
them costs one extra fast-tokenizer call per micro-batch, well under 1 % of encoding time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError, is_token_array, over_limit, require_embedding_inputs
from gpuworkers.engines.torch_memory import TorchModelHolder
from gpuworkers.sources import forbid_hub_downloads, resolve_model_source
from gpuworkers.spec import ModelSpec

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

_LOAD_PARAMS = frozenset({"max_seq_length", "half_precision"})


class SentenceTransformersEngine(TorchModelHolder):
    """Embeds texts and token arrays (the model's token ids, taken as given); load once per worker process,
    then call `run_batch` per micro-batch.

    Params of `run_batch`: ``batch_size`` (inputs per forward pass, default 32) and ``normalize``
    (unit-length embeddings, default false). An input over ``max_seq_length`` tokens is refused by
    `too_long` unless params say ``truncate: true``; then the model reads its first ``max_seq_length``.
    Load params: ``max_seq_length`` (tokens kept per input) and ``half_precision``
    (float16 weights on a GPU, the default there; never on the CPU).
    """

    # It orders a micro-batch's forward passes by token counts; grouping across micro-batches is batching's.
    pads_to_longest = True

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._model: SentenceTransformer | None = None
        # The texts `too_long` measured last, with their full token counts: `run_batch` on the same texts,
        # which follows it for every micro-batch, takes its usage from them instead of tokenizing again.
        self._measured: dict[str, int] = {}

    def load(self, *, device: str) -> None:
        if self.spec.task != "embed":
            raise EngineLoadError(f"the sentence_transformers engine runs task 'embed', not {self.spec.task!r}")
        unknown = set(self.spec.load_params) - _LOAD_PARAMS
        if unknown:
            raise EngineLoadError(
                f"unknown load params for sentence_transformers: {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(_LOAD_PARAMS))}"
            )
        path = resolve_model_source(self.spec.source)
        forbid_hub_downloads()
        settings.apply_torch_threads()
        from sentence_transformers import SentenceTransformer

        try:
            model = SentenceTransformer(str(path), device=device, local_files_only=True)
        except Exception as exc:
            raise EngineLoadError(f"cannot load {self.spec.name!r} from {path}: {type(exc).__name__}: {exc}") from exc
        if "max_seq_length" in self.spec.load_params:
            model.max_seq_length = int(self.spec.load_params["max_seq_length"])
        if device.startswith("cuda") and self.spec.load_params.get("half_precision", True):
            # float16 halves the weights' memory and runs on the GPU's tensor cores.
            model.half()
        model.eval()
        self._model = model

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        model = self._loaded_model()
        items = require_embedding_inputs(inputs, len(model.tokenizer))
        if not items:
            return []
        batch_size = params.get("batch_size", 32)
        normalize = params.get("normalize", False)
        texts = [item for item in items if isinstance(item, str)]
        arrays = [item for item in items if not isinstance(item, str)]
        counts = self._usage_counts(model, texts) if texts else []
        embedded_texts = iter(_encode_by_tokens(model, texts, counts, batch_size, normalize))
        embedded_arrays = iter(_encode_token_arrays(model, arrays, batch_size, normalize) if arrays else [])
        text_counts = iter(counts)
        limit = model.max_seq_length
        return [
            # The array stays numpy: orjson writes float32 directly, in half the bytes of Python floats.
            {"embedding": next(embedded_texts), "usage": {"prompt_tokens": next(text_counts)}}
            if isinstance(item, str)
            else {"embedding": next(embedded_arrays), "usage": {"prompt_tokens": _kept(len(item), limit)}}
            for item in items
        ]

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """For each input, its length where it is over the model's ``max_seq_length`` tokens, else None."""
        model = self._loaded_model()
        limit = model.max_seq_length
        if limit is None:
            return [None] * len(inputs)
        # Anything else than a text or a token array is measured as empty: `run_batch` refuses it itself.
        texts = [item for item in inputs if isinstance(item, str)]
        counts = iter(self._token_counts(model, texts, truncate=False) if texts else [])
        lengths = [
            next(counts) if isinstance(item, str) else len(item) if is_token_array(item) else 0 for item in inputs
        ]
        self._measured = {item: length for item, length in zip(inputs, lengths, strict=True) if isinstance(item, str)}
        return over_limit(lengths, limit)

    def _loaded_model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._model

    def _usage_counts(self, model: SentenceTransformer, texts: list[str]) -> list[int]:
        """The tokens the model reads of each text: its full count cut at ``max_seq_length``, as truncation
        cuts it, from what `too_long` measured where it measured these texts."""
        measured, self._measured = self._measured, {}
        if not all(text in measured for text in texts):
            return self._token_counts(model, texts)
        return [_kept(measured[text], model.max_seq_length) for text in texts]

    @staticmethod
    def _token_counts(model: SentenceTransformer, texts: list[str], *, truncate: bool = True) -> list[int]:
        encoded = model.tokenizer(
            texts,
            truncation=truncate and model.max_seq_length is not None,
            max_length=model.max_seq_length,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return [len(ids) for ids in encoded["input_ids"]]


def _kept(tokens: int, limit: int | None) -> int:
    """Of an input of ``tokens`` tokens, those the model reads: truncation keeps the first ``limit``."""
    return tokens if limit is None else min(tokens, limit)


def _encode_by_tokens(
    model: SentenceTransformer, texts: list[str], tokens: list[int], batch_size: int, normalize: bool
) -> list[Any]:
    """The texts' embeddings, in order, from forward passes of ``batch_size`` texts of close token counts.

    `SentenceTransformer.encode` sorts a call's texts by characters, a loose stand-in for tokens that
    leaves more padding in each forward pass than sorting by token counts. One call per forward pass
    keeps this order.
    """
    embedded: list[Any] = [None] * len(texts)
    order = sorted(range(len(texts)), key=tokens.__getitem__)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        vectors = model.encode(
            [texts[index] for index in chunk],
            batch_size=batch_size,
            normalize_embeddings=normalize,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        for index, vector in zip(chunk, vectors, strict=True):
            embedded[index] = vector
    return embedded


def _encode_token_arrays(
    model: SentenceTransformer, arrays: list[list[int]], batch_size: int, normalize: bool
) -> list[Any]:
    """Embeddings of inputs given as the model's token ids, used as they are (no special tokens added),
    cut at ``max_seq_length`` as texts are: the model's own modules run on them, as `encode` runs them."""
    import torch

    limit = model.max_seq_length
    kept = [ids[:limit] if limit is not None else ids for ids in arrays]
    embeddings: list[Any] = []
    for start in range(0, len(kept), batch_size):
        padded = model.tokenizer.pad({"input_ids": kept[start : start + batch_size]}, return_tensors="pt")
        features = {name: tensor.to(model.device) for name, tensor in padded.items()}
        with torch.inference_mode():
            batch = model(features)["sentence_embedding"].float()
        if normalize:
            batch = torch.nn.functional.normalize(batch, p=2, dim=1)
        embeddings.extend(batch.cpu().numpy())
    return embeddings
