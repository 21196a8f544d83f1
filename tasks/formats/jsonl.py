"""JSONL input: stream records one line at a time, checking each, with bounded memory.

Duplicate `custom_id`s are found without keeping the ids: 64-bit hashes go into a compact array
that is sorted once at the end. Only if two hashes collide is the input read a second time, to name
the duplicate lines exactly.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from tasks.formats.records import LineProblem, Record

MAX_LINE_BYTES = 16 * 1024 * 1024


def _id_hash(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


def _parse_line(raw: bytes, line_no: int, input_field: str) -> Record | LineProblem:
    if len(raw) > MAX_LINE_BYTES:
        return LineProblem(line_no, f"line is longer than {MAX_LINE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        return LineProblem(line_no, "not valid UTF-8")
    except json.JSONDecodeError as exc:
        return LineProblem(line_no, f"not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(data, dict):
        return LineProblem(line_no, f"expected a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id", str(line_no))
    if not isinstance(custom_id, str) or not custom_id:
        return LineProblem(line_no, "custom_id must be a non-empty string")
    if input_field not in data:
        return LineProblem(line_no, f"missing field {input_field!r}")
    data["custom_id"] = custom_id
    return Record(line=line_no, custom_id=custom_id, data=data)


@dataclass
class JsonlCheck:
    """The outcome of reading a whole input: counts and the first problems found."""

    records: int = 0
    problems: list[LineProblem] = field(default_factory=list)
    problem_count: int = 0
    id_hashes: array[int] = field(default_factory=lambda: array("Q"), repr=False)
    """64-bit hashes of every valid record's custom_id, 8 bytes a record."""

    @property
    def ok(self) -> bool:
        return self.problem_count == 0 and self.records > 0

    def summary(self, *, limit: int) -> str:
        if self.problem_count == 0 and self.records == 0:
            return "the input has no records"
        shown = "; ".join(str(p) for p in self.problems[:limit])
        more = self.problem_count - min(limit, len(self.problems))
        suffix = f"; and {more} more bad line{'s' if more != 1 else ''}" if more > 0 else ""
        return f"{self.problem_count} bad line{'s' if self.problem_count != 1 else ''}: {shown}{suffix}"


def iter_jsonl(stream: BinaryIO, *, input_field: str, check: JsonlCheck, max_problems: int = 100) -> Iterator[Record]:
    """Yield valid records in input order; bad lines are counted into `check`, not yielded.

    Blank lines are skipped but still count towards line numbers. Duplicate ids are reported by
    `finish_duplicate_check` once the stream is exhausted.
    """
    for line_no, raw in enumerate(stream, start=1):
        if not raw.strip():
            continue
        parsed = _parse_line(raw, line_no, input_field)
        if isinstance(parsed, LineProblem):
            check.problem_count += 1
            if len(check.problems) < max_problems:
                check.problems.append(parsed)
            continue
        check.id_hashes.append(_id_hash(parsed.custom_id))
        check.records += 1
        yield parsed


def has_colliding_ids(check: JsonlCheck) -> bool:
    """True if two records may share a custom_id (their 64-bit hashes collide)."""
    import numpy as np

    hashes = np.frombuffer(check.id_hashes, dtype=np.uint64)
    if hashes.size < 2:
        return False
    ordered = np.sort(hashes)
    return bool((ordered[1:] == ordered[:-1]).any())


def find_duplicate_ids(
    reopen: Callable[[], BinaryIO], *, input_field: str, check: JsonlCheck, max_problems: int = 100
) -> None:
    """Second pass, only after a hash collision: name each line whose custom_id was seen before."""
    first_seen: dict[str, int] = {}
    with reopen() as stream:
        for line_no, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            parsed = _parse_line(raw, line_no, input_field)
            if isinstance(parsed, LineProblem):
                continue
            first = first_seen.setdefault(parsed.custom_id, line_no)
            if first != line_no:
                check.problem_count += 1
                check.records -= 1
                if len(check.problems) < max_problems:
                    check.problems.append(
                        LineProblem(line_no, f"duplicate custom_id {parsed.custom_id!r} (first on line {first})")
                    )
    check.problems.sort(key=lambda problem: problem.line)


def check_jsonl(reopen: Callable[[], BinaryIO], *, input_field: str, max_problems: int = 100) -> JsonlCheck:
    """Read a whole input once (twice if ids may collide) and report every problem."""
    check = JsonlCheck()
    with reopen() as stream:
        for _ in iter_jsonl(stream, input_field=input_field, check=check, max_problems=max_problems):
            pass
    if has_colliding_ids(check):
        find_duplicate_ids(reopen, input_field=input_field, check=check, max_problems=max_problems)
    return check
