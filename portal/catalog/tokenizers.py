"""Counting a model's input tokens on the control side, with the model's own tokenizer.

The dry run (`portal.jobs.services.dry_run`) counts each record's tokens the way the engines feed
them to the model. Only the engines whose tokenizer loads cheaply from the weights' directory (a few
files, no weights) count: `transformers`, `vllm`, `sentence_transformers`; a `python` model's tokens
are its own business. Loaded tokenizers are kept per process in a small LRU.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from gpuworkers.sources import resolve_model_source
from portal.catalog.models import Model

logger = logging.getLogger(__name__)

TOKENIZED_ENGINES = frozenset({Model.Engine.TRANSFORMERS, Model.Engine.VLLM, Model.Engine.SENTENCE_TRANSFORMERS})
LENGTH_PARAMS = ("max_seq_length", "max_model_len")
"""Load params that set the most tokens an input may hold: sentence-transformers', vLLM's."""
REMOTE_SOURCE_PREFIXES = ("s3://",)
# A tokenizer that does not know its model's length says int(1e30); nothing real comes near this.
SANE_MAX_LENGTH = 1_000_000


@dataclass(frozen=True)
class TokenCounter:
    """A model's tokenizer and the most tokens one input of the model may hold."""

    tokenizer: Any
    """A Hugging Face `PreTrainedTokenizerBase`."""
    max_tokens: int | None
    """Load params' `max_seq_length` or `max_model_len`, else the sentence-transformers config's
    `max_seq_length`, else the tokenizer's `model_max_length`; None where none is known."""

    def count(self, values: Sequence[Any]) -> list[int]:
        """Tokens of each input value (a text, or chat messages), special tokens included, untruncated."""
        counts = [0] * len(values)
        plain: list[tuple[int, str]] = []
        rendered: list[tuple[int, str]] = []
        for index, value in enumerate(values):
            if isinstance(value, str):
                plain.append((index, value))
            elif (chat := self._render_chat(value)) is not None:
                rendered.append((index, chat))
            else:
                plain.append((index, "\n".join(_message_texts(value))))
        # A rendered chat template already holds the model's special tokens, as in the transformers engine.
        for group, special in ((plain, True), (rendered, False)):
            if not group:
                continue
            encoded = self.tokenizer(
                [text for _, text in group],
                add_special_tokens=special,
                return_attention_mask=False,
                return_token_type_ids=False,
                verbose=False,
            )
            for (index, _), ids in zip(group, encoded["input_ids"], strict=True):
                counts[index] = len(ids)
        return counts

    def _render_chat(self, messages: Any) -> str | None:
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        try:
            return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        except Exception:
            # Content the template cannot render (parts, a missing content) fails its record at run
            # time; here its texts are counted instead.
            return None


def _message_texts(messages: Any) -> list[str]:
    """The texts of chat messages: string contents and the `text` of content parts."""
    texts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            parts = [part for part in content if isinstance(part, dict)]
            texts.extend(part["text"] for part in parts if isinstance(part.get("text"), str))
    return texts


def token_counter(model: Model) -> TokenCounter | None:
    """The model's token counter; None for an engine without a tokenizer, or one that will not load (logged)."""
    if model.engine not in TOKENIZED_ENGINES:
        return None
    if model.source.startswith(REMOTE_SOURCE_PREFIXES):
        # Resolving it would download every weight file onto the control host for a few tokenizer files.
        logger.info("no tokens counted for model %s: its weights are in object storage (%s)", model, model.source)
        return None
    try:
        tokenizer, configured = _load(model.source)
    except Exception as exc:
        # Whatever the reason (no local directory, an s3:// source, a broken file), the dry run goes on without counts.
        logger.warning("no tokenizer for model %s from %r: %s: %s", model, model.source, type(exc).__name__, exc)
        return None
    return TokenCounter(tokenizer=tokenizer, max_tokens=_max_tokens(model, tokenizer, configured))


def _max_tokens(model: Model, tokenizer: Any, sentence_transformers_max: int | None) -> int | None:
    for name in LENGTH_PARAMS:
        if _positive_int(value := model.load_params.get(name)):
            return value
    # sentence-transformers truncates at its own config's length, often below the tokenizer's.
    if model.engine == Model.Engine.SENTENCE_TRANSFORMERS and sentence_transformers_max is not None:
        return sentence_transformers_max
    length = getattr(tokenizer, "model_max_length", None)
    return length if _positive_int(length) and length < SANE_MAX_LENGTH else None


def _positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@functools.lru_cache(maxsize=8)
def _load(source: str) -> tuple[Any, int | None]:
    """The tokenizer in the source's directory, and its sentence-transformers `max_seq_length` if it has one.

    A failure raises, and is not cached: a source fixed later loads on the next call.
    """
    directory = resolve_model_source(source)
    # Imported here: transformers takes seconds to import, and only the dry run needs it in the portal.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return tokenizer, _sentence_transformers_max(directory)


def _sentence_transformers_max(directory: Path) -> int | None:
    try:
        value = json.loads((directory / "sentence_bert_config.json").read_text()).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return value if _positive_int(value) else None
