"""Task ``classify`` on the ``transformers`` engine: a sequence-classification model's scores per label.

Each response is ``{"scores": {label: probability}, "label": the likeliest, "usage": {"prompt_tokens": n}}``.
A model trained for several labels at once (``problem_type`` ``multi_label_classification``, as moderation
and toxicity models are) scores each label on its own (sigmoid); any other one spreads one probability over
its labels (softmax). The labels are the model's ``id2label``, renamed by the load param ``label_map``
(e.g. a toxicity model's ``{"toxic": "harassment"}``) where a consumer, such as ``/v1/moderations``, reads
fixed names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuworkers import settings
from gpuworkers.engines.base import EngineLoadError, over_limit
from gpuworkers.engines.torch_memory import TorchModelHolder
from gpuworkers.sources import forbid_hub_downloads, resolve_model_source
from gpuworkers.spec import ModelSpec

_LOAD_PARAMS = frozenset({"label_map"})


class SequenceClassifierEngine(TorchModelHolder):
    """Scores texts; params of `run_batch`: ``batch_size`` (texts per forward pass, 32) and ``truncate``.

    A text longer than the model's positions is refused by `too_long` unless ``truncate`` is true, then it
    keeps its first tokens.
    """

    # Each forward pass pads its texts, taken in the micro-batch's order, to the longest of them.
    pads_to_longest = True

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._model: Any = None
        self._tokenizer: Any = None
        self._labels: list[str] = []
        self._max_tokens: int | None = None

    def load(self, *, device: str) -> None:
        if self.spec.task != "classify":
            raise EngineLoadError(f"the sequence classifier runs task 'classify', not {self.spec.task!r}")
        unknown = set(self.spec.load_params) - _LOAD_PARAMS
        if unknown:
            raise EngineLoadError(f"unknown load params for classify: {', '.join(sorted(unknown))}; known: label_map")
        path = resolve_model_source(self.spec.source)
        forbid_hub_downloads()
        settings.apply_torch_threads()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            raise EngineLoadError(f"cannot load {self.spec.name!r} from {path}: {type(exc).__name__}: {exc}") from exc
        if tokenizer.pad_token is None:
            # A classifier on a decoder (GPT-2 style) often ships without one; it pads with its end token and
            # reads the last real token, which `pad_token_id` tells the model.
            if tokenizer.eos_token is None:
                raise EngineLoadError(f"the tokenizer of {self.spec.name!r} has neither a pad nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
            model.config.pad_token_id = tokenizer.pad_token_id
        model.to(device)
        model.eval()
        self._labels = self._renamed_labels(model.config.id2label)
        self._max_tokens = getattr(model.config, "max_position_embeddings", None)
        self._model, self._tokenizer = model, tokenizer

    def _renamed_labels(self, id2label: Mapping[int, str]) -> list[str]:
        label_map = self.spec.load_params.get("label_map") or {}
        if not isinstance(label_map, dict) or not all(isinstance(value, str) for value in label_map.values()):
            raise EngineLoadError("label_map must map the model's labels to names (strings)")
        labels = [str(label_map.get(id2label[index], id2label[index])) for index in range(len(id2label))]
        if len(set(labels)) != len(labels):
            raise EngineLoadError(f"label_map gives two labels the same name: {labels}")
        return labels

    @property
    def labels(self) -> list[str]:
        """The labels scored, in the model's order, after ``label_map``."""
        return list(self._labels)

    def run_batch(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[dict[str, Any]]:
        model, tokenizer = self._loaded()
        texts = _require_texts(inputs)
        if not texts:
            return []
        import torch

        batch_size = int(params.get("batch_size") or 32)
        multi_label = model.config.problem_type == "multi_label_classification"
        responses: list[dict[str, Any]] = []
        for start in range(0, len(texts), batch_size):
            encoded = tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=self._max_tokens is not None,
                max_length=self._max_tokens,
                return_tensors="pt",
            ).to(model.device)
            with torch.inference_mode():
                logits = model(**encoded).logits.float()
            probabilities = torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)
            counts = encoded["attention_mask"].sum(dim=1).tolist()
            for row, count in zip(probabilities.tolist(), counts, strict=True):
                scores = dict(zip(self._labels, row, strict=True))
                responses.append(
                    {"scores": scores, "label": max(scores, key=scores.__getitem__), "usage": {"prompt_tokens": count}}
                )
        return responses

    def too_long(self, inputs: Sequence[Any], params: Mapping[str, Any]) -> list[str | None]:
        """For each text, its length where it is over the model's positions, else None."""
        _, tokenizer = self._loaded()
        if self._max_tokens is None:
            return [None] * len(inputs)
        texts = [text if isinstance(text, str) else "" for text in inputs]
        counts = [len(ids) for ids in tokenizer(texts, return_attention_mask=False)["input_ids"]]
        return over_limit(counts, self._max_tokens)

    def _loaded(self) -> tuple[Any, Any]:
        if self._model is None:
            raise RuntimeError(f"engine for {self.spec.name!r} is not loaded; call load() first")
        return self._model, self._tokenizer


def _require_texts(inputs: Sequence[Any]) -> list[str]:
    texts = list(inputs)
    for text in texts:
        if not isinstance(text, str) or not text:
            raise ValueError(f"the input must be a non-empty string, not {type(text).__name__}")
    return texts
