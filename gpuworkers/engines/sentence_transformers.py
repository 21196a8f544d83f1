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
from gpuworkers.engines.base import EngineLoadError, over_limit
from gpuworkers.engines.torch_memory import module_bytes, release_memory
from gpuworkers.sources import forbid_hub_downloads, resolve_model_source
from gpuworkers.spec import ModelSpec

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

_LOAD_PARAMS = frozenset({"max_seq_length", "half_precision"})


class SentenceTransformersEngine:
    """Embeds text; load once per worker process, then call `run_batch` per micro-batch.

    Params of `run_batch`: ``batch_size`` (inputs per forward pass, default 32) and ``normalize``
    (unit-length embeddings, default false). A text over ``max_seq_length`` tokens is refused by
    `too_long` unless params say ``truncate: true``; then the model reads its first ``max_seq_length``.
    Load params: ``max_seq_length`` (tokens kept per input) and ``half_precision``
    (float16 weights on a GPU, the default there; never on the CPU).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._model: SentenceTransformer | None = None

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
        texts = _require_texts(inputs)
        if not texts:
            return []
        embeddings = model.encode(
            texts,
            batch_size=params.get("batch_size", 32),
            normalize_embeddings=params.get("normalize", False),
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        token_counts = self._token_counts(model, texts)
        return [
            # The array stays numpy: orjson writes float32 directly, in half the bytes of Python floats.
            {"embedding": embedding, "usage": {"prompt_tokens": count}}
            for embedding, count in zip(embeddings, token_counts, strict=True)
        ]

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """For each text, its length where it is over the model's ``max_seq_length`` tokens, else None."""
        model = self._loaded_model()
        limit = model.max_seq_length
        if limit is None:
            return [None] * len(inputs)
        # A non-text is measured as empty: `run_batch` refuses it with its own message.
        texts = [text if isinstance(text, str) else "" for text in inputs]
        return over_limit(self._token_counts(model, texts, truncate=False), limit)

    def memory_bytes(self) -> int:
        return 0 if self._model is None else module_bytes(self._model)

    def unload(self) -> None:
        if self._model is None:
            return
        self._model = None
        release_memory()

    def _loaded_model(self) -> SentenceTransformer:
        if self._model is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._model

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


def _require_texts(inputs: Sequence[Any]) -> list[str]:
    # No position in the messages: a failing micro-batch is run again record by record, and the
    # message a record ends up with comes from a batch of one.
    texts = list(inputs)
    for text in texts:
        if not isinstance(text, str):
            raise ValueError(f"the input must be a string, not {type(text).__name__}")
        if not text:
            raise ValueError("the input is an empty string")
    return texts
