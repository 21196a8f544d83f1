"""Figures of a generation or chat re-run: how often each record's text stayed the same, how far it moved
(normalised edit distance), how its length and finish reason changed, and the records that changed most.

A response's text is its `text` (the engines' native shape, chat included: the assistant's reply), or,
in OpenAI's shapes, its first choice's `message.content` or `text`.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Any

from portal.jobs.comparison.edit_distance import normalised_edit_distance
from portal.jobs.comparison.figures import MostChanged, distribution
from portal.jobs.comparison.pairs import Pair

EDIT_DISTANCE_EDGES = [index / 10 for index in range(11)]
"""Ten bins of a tenth each, from 0 (the same text) to 1."""
SHOWN_CHARS = 300
"""Of a changed record's texts, the report shows this many characters each."""


def response_text(response: dict[str, Any]) -> str:
    """The text of a generation or chat response (see the module's doc); empty where it has none."""
    if isinstance(response.get("text"), str):
        return str(response["text"])
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = choices[0]
        message = first.get("message")
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return str(message["content"])
        if isinstance(first.get("text"), str):
            return str(first["text"])
    return ""


def _finish_reason(response: dict[str, Any]) -> str:
    reason = response.get("finish_reason")
    choices = response.get("choices")
    if reason is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
    return str(reason) if reason is not None else "none"


def _completion_tokens(response: dict[str, Any]) -> int | None:
    usage = response.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else None


class TextComparison:
    """Takes the records that succeeded on both sides (`add`), one at a time; `figures` reports them.
    Memory: 8 bytes a record (the distances, for their percentiles) and `most_changed` records. The edit
    distance is measured on each text's first `max_chars` characters: its cost grows with the product of
    the two lengths, and a generation may be as long as its tenant asks."""

    def __init__(self, *, most_changed: int, max_chars: int) -> None:
        self._max_chars = max_chars
        self._cut = 0
        self._distances = array("d")
        self._exact = 0
        self._char_change = 0
        self._token_change = 0
        self._token_records = 0
        self._finish = Counter[str]()
        self._most = MostChanged(most_changed)

    def add(self, pair: Pair) -> None:
        old, new = pair.old["response"], pair.new["response"]
        old_text, new_text = response_text(old), response_text(new)
        cap = self._max_chars
        if len(old_text) > cap or len(new_text) > cap:
            self._cut += 1
        distance = normalised_edit_distance(old_text[:cap], new_text[:cap])
        if distance == 0 and old_text != new_text:
            # Equal prefixes of different texts: changed, by less than the prefix can show.
            distance = min(1.0, 1 / cap)
        self._distances.append(distance)
        self._exact += old_text == new_text
        self._char_change += len(new_text) - len(old_text)
        old_tokens, new_tokens = _completion_tokens(old), _completion_tokens(new)
        if old_tokens is not None and new_tokens is not None:
            self._token_change += new_tokens - old_tokens
            self._token_records += 1
        old_reason, new_reason = _finish_reason(old), _finish_reason(new)
        if old_reason != new_reason:
            self._finish[f"{old_reason}->{new_reason}"] += 1
        if distance > 0:
            self._most.offer(
                distance,
                {
                    "custom_id": pair.custom_id,
                    "edit_distance": distance,
                    "old": old_text[:SHOWN_CHARS],
                    "new": new_text[:SHOWN_CHARS],
                },
            )

    def figures(self) -> dict[str, Any]:
        """`exact_match_rate` (of the records compared), `edit_distance` (the distribution of the normalised
        edit distance, `figures.distribution`), `mean_length_change` (`chars`, and `completion_tokens` over
        the records whose usage counts them both times), `finish_reason_changes` (`"old->new"`: records),
        `most_changed` (highest distance first, each with its texts cut to `SHOWN_CHARS`) and
        `edit_distance_prefix` (`chars` measured of each text, `records` whose texts were longer)."""
        count = len(self._distances)
        return {
            "exact_match_rate": self._exact / count if count else None,
            "edit_distance": distribution(self._distances, edges=EDIT_DISTANCE_EDGES),
            "mean_length_change": {
                "chars": self._char_change / count if count else None,
                "completion_tokens": self._token_change / self._token_records if self._token_records else None,
            },
            "finish_reason_changes": dict(sorted(self._finish.items())),
            "most_changed": self._most.entries(),
            "edit_distance_prefix": {"chars": self._max_chars, "records": self._cut},
        }
