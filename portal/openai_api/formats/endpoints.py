"""The OpenAI endpoints a batch may target, and the Batchery model task that serves each."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchEndpoint:
    """An OpenAI endpoint a batch may target, and the Batchery model task that serves it."""

    url: str
    """The endpoint as OpenAI names it, e.g. ``/v1/embeddings``."""
    task: str
    """The model task that runs its requests."""
    input_field: str
    """The record field the task reads (`tasks.shared.formats.records.input_field_for`)."""
    body_field: str | None = None
    """The body field holding the request's input, where it is not ``input_field``."""

    @property
    def request_field(self) -> str:
        return self.body_field or self.input_field


RESPONSES = "/v1/responses"
MODERATIONS = "/v1/moderations"

ENDPOINTS: Mapping[str, BatchEndpoint] = {
    endpoint.url: endpoint
    for endpoint in (
        BatchEndpoint("/v1/embeddings", "embed", "input"),
        BatchEndpoint("/v1/completions", "generate", "prompt"),
        BatchEndpoint("/v1/chat/completions", "chat", "messages"),
        # The Responses API's text form: its input (and instructions) become a conversation for task chat.
        BatchEndpoint(RESPONSES, "chat", "messages", body_field="input"),
        # Served by a classification model whose labels are OpenAI's moderation categories.
        BatchEndpoint(MODERATIONS, "classify", "input"),
    )
}

MODERATION_CATEGORIES = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/instructions",
    "self-harm/intent",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
"""OpenAI's moderation categories: a moderation model's labels (after its catalog ``label_map``)."""

MODERATION_THRESHOLD = 0.5
"""A category's score from which the input is flagged for it."""


class UnsupportedEndpoint(ValueError):
    """A batch endpoint Batchery does not serve."""


def endpoint_for(url: str) -> BatchEndpoint:
    try:
        return ENDPOINTS[url]
    except KeyError:
        raise UnsupportedEndpoint(
            f"endpoint {url!r} is not supported for batches; supported: {', '.join(ENDPOINTS)}"
        ) from None


EMBEDDING_ENCODINGS = ("float", "base64")
"""The ``encoding_format`` values of ``/v1/embeddings``."""
