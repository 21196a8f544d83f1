"""What a record must hold for each model task, and the line-numbered problems an input can have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuworkers.engines.base import is_token_array, json_kind
from gpuworkers.engines.media import messages_media_problem

# The field each task reads from a record; the names follow the bodies of OpenAI's endpoints so an
# OpenAI request body is also a valid record.
TASK_INPUT_FIELDS: dict[str, str] = {
    "embed": "input",
    "classify": "input",
    "generate": "prompt",
    "chat": "messages",
}


def input_field_for(task: str) -> str:
    try:
        return TASK_INPUT_FIELDS[task]
    except KeyError:
        raise ValueError(f"unknown model task {task!r}; known: {', '.join(sorted(TASK_INPUT_FIELDS))}") from None


REFUSED_FIELD = "refused"
"""A record that carries this field, a message saying what is wrong with the request it stands for, does not run:
its output line is the error ``invalid_request`` with that message, in its place. How an API whose requests each
stand or fall alone (Anthropic's message batches) keeps a request it refused at submission among the others."""

MAX_INPUT_TEXTS = 2048
"""Texts one record's `input` may list, as OpenAI's embeddings endpoint allows in one request."""


def input_problem(input_field: str, value: Any) -> str | None:
    """What is wrong with a record's input value for the task that reads `input_field`; None if nothing.

    The shape every engine of the task needs: text for `prompt`, a non-empty list of message objects
    for `messages`, and for `input` a text, a token array (a non-empty list of token ids), or a
    non-empty list of either kind (an embedding model gives one embedding each, in order). Token ids
    are the model's own, as vLLM's OpenAI server takes them: the engine checks them against the
    model's vocabulary. Checked with the rest of the record, at submission or planning, so that a
    wrong type refuses the input up front instead of failing its record at run time.

    A message's content parts are held to `gpuworkers.engines.media` with every kind of media allowed: no part
    of a type not served, no media URL that a slot would fetch (unless on an operator's media host), no inline
    media over the bounds. Whether the model takes a kind of media is its catalog entry's to say, which the
    portal checks beside this (`portal.jobs.record_checks`).
    """
    if input_field == TASK_INPUT_FIELDS["chat"]:
        if not isinstance(value, list) or not value:
            return f"{input_field} must be a non-empty array of message objects, not {json_kind(value)}"
        for number, message in enumerate(value, 1):
            if not isinstance(message, dict):
                return f"{input_field} must hold message objects; message {number} is {json_kind(message)}"
        problem = messages_media_problem(value, field=input_field)
        return None if problem is None else problem.message
    if input_field == TASK_INPUT_FIELDS["embed"] and isinstance(value, list):
        return _texts_problem(input_field, value)
    if not isinstance(value, str):
        return f"{input_field} must be a string, not {json_kind(value)}"
    return None


def _texts_problem(input_field: str, texts: list[Any]) -> str | None:
    if not texts:
        return f"{input_field} must be a string or a non-empty array of strings, not an empty array"
    if all(type(item) is int for item in texts):
        problem = _token_array_problem(texts)
        return None if problem is None else f"{input_field} is a token array whose {problem}"
    if len(texts) > MAX_INPUT_TEXTS:
        return f"{input_field} holds {len(texts)} texts, over the limit of {MAX_INPUT_TEXTS} a record"
    if isinstance(texts[0], list):
        for number, tokens in enumerate(texts, 1):
            if not is_token_array(tokens):
                some_list = isinstance(tokens, list) and tokens
                kind = "an array of something else than token ids" if some_list else json_kind(tokens)
                return f"{input_field} must hold token arrays alike; item {number} is {kind}"
            if (problem := _token_array_problem(tokens)) is not None:
                return f"{input_field} must hold token arrays; the {problem}, in item {number}"
        return None
    for number, text in enumerate(texts, 1):
        if not isinstance(text, str):
            return f"{input_field} must hold strings; item {number} is {json_kind(text)}"
    return None


def _token_array_problem(tokens: list[int]) -> str | None:
    negative = next((place for place, token in enumerate(tokens) if token < 0), None)
    return None if negative is None else f"token {negative} is negative ({tokens[negative]})"


@dataclass(frozen=True)
class LineProblem:
    """One bad input line."""

    line: int
    """1-based physical line number in the input file."""
    message: str
    """What is wrong with it, for a person."""

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class Record:
    """One valid input record."""

    line: int
    """1-based physical line number in the input file."""
    custom_id: str
    """The record's identity end to end: given, or its line number."""
    data: dict[str, Any]
    """The record as parsed, with `custom_id` filled in."""

    @property
    def refused(self) -> bool:
        """The record was refused at submission (`REFUSED_FIELD`): it holds no input and does not run."""
        return REFUSED_FIELD in self.data
