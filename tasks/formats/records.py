"""What a record must hold for each model task, and the line-numbered problems an input can have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
