"""Both outputs of a re-run, read side by side line by line: each record's old and new output line.

Both jobs ran the same input, and an output holds one line per input record in input order, so the
two files zip; a line whose `custom_id` differs from its partner's means they are not outputs of one
input, and the comparison stops rather than compare unrelated records. Memory: two lines at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

import orjson

from tasks.shared.storage import store_for


class OutputsDiffer(Exception):
    """The two outputs are not of one input: a line count or a `custom_id` differs."""


@dataclass(frozen=True)
class Pair:
    """One record's two output lines."""

    custom_id: str
    old: dict[str, Any]
    """Its line in the job re-run: `{"custom_id", "response"}` or `{"custom_id", "error"}`."""
    new: dict[str, Any]
    """Its line in the re-run."""

    @property
    def both_ok(self) -> bool:
        return "response" in self.old and "response" in self.new


def _lines(stream: Any) -> Iterator[dict[str, Any]]:
    for raw in stream:
        if raw.strip():
            yield orjson.loads(raw)


def output_pairs(old_uri: str, new_uri: str) -> Iterator[Pair]:
    """Each record's old and new output line, in input order; raises `OutputsDiffer` where they part."""
    with store_for(old_uri).open_read(old_uri) as old, store_for(new_uri).open_read(new_uri) as new:
        for number, (old_line, new_line) in enumerate(zip_longest(_lines(old), _lines(new)), start=1):
            if old_line is None or new_line is None:
                longer = "re-run" if old_line is None else "job re-run"
                raise OutputsDiffer(f"the {longer}'s output has more lines than the other's (line {number})")
            if old_line["custom_id"] != new_line["custom_id"]:
                raise OutputsDiffer(
                    f"line {number}: custom_id {old_line['custom_id']!r} in the job re-run, "
                    f"{new_line['custom_id']!r} in the re-run"
                )
            yield Pair(custom_id=str(new_line["custom_id"]), old=old_line, new=new_line)
