"""JSONL input: stream records one line at a time, checking each, with bounded memory.

A line is read with a length limit, so one enormous line cannot exhaust memory. Duplicate
`custom_id`s are found without keeping the ids: 64-bit hashes go into a compact array (8 bytes a
record) that is sorted once at the end. Only if two hashes collide is the input read a second time,
keeping just the ids whose hash collided, to name the duplicate lines exactly.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import orjson

from tasks.formats.records import LineProblem, Record

MAX_LINE_BYTES = 16 * 1024 * 1024


def _id_hash(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


def _lines(stream: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """Numbered lines; a line over MAX_LINE_BYTES is skipped to its end and yielded as None."""
    line_no = 0
    while True:
        raw = stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := stream.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield line_no, None
            continue
        yield line_no, raw


def _parse_line(raw: bytes | None, line_no: int, input_field: str) -> Record | LineProblem:
    if raw is None:
        return LineProblem(line_no, f"line is longer than {MAX_LINE_BYTES} bytes")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
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
        """No bad line; an input without records is fine (its job ends with an empty output)."""
        return self.problem_count == 0

    def summary(self, *, limit: int) -> str:
        shown = "; ".join(str(p) for p in self.problems[:limit])
        more = self.problem_count - min(limit, len(self.problems))
        suffix = f"; and {more} more bad line{'s' if more != 1 else ''}" if more > 0 else ""
        return f"{self.problem_count} bad line{'s' if self.problem_count != 1 else ''}: {shown}{suffix}"

    def add_problem(self, problem: LineProblem, *, max_problems: int) -> None:
        self.problem_count += 1
        if len(self.problems) < max_problems:
            self.problems.append(problem)


def iter_jsonl(stream: BinaryIO, *, input_field: str, check: JsonlCheck, max_problems: int = 100) -> Iterator[Record]:
    """Yield valid records in input order; bad lines are counted into `check`, not yielded.

    Blank lines are skipped but still count towards line numbers. Duplicate ids are found after
    the stream is exhausted: see `colliding_id_hashes` and `find_duplicate_ids`.
    """
    for line_no, raw in _lines(stream):
        if raw is not None and not raw.strip():
            continue
        parsed = _parse_line(raw, line_no, input_field)
        if isinstance(parsed, LineProblem):
            check.add_problem(parsed, max_problems=max_problems)
            continue
        check.id_hashes.append(_id_hash(parsed.custom_id))
        check.records += 1
        yield parsed


def colliding_id_hashes(check: JsonlCheck) -> set[int]:
    """Hashes shared by two or more records: their ids may be duplicates."""
    import numpy as np

    hashes = np.frombuffer(check.id_hashes, dtype=np.uint64)
    if hashes.size < 2:
        return set()
    ordered = np.sort(hashes)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return {int(value) for value in np.unique(repeated)}


def find_duplicate_ids(
    reopen: Callable[[], BinaryIO],
    *,
    input_field: str,
    check: JsonlCheck,
    suspects: set[int],
    max_problems: int = 100,
) -> None:
    """Second pass, only after a hash collision: name each line whose custom_id was seen before."""
    first_seen: dict[str, int] = {}
    with reopen() as stream:
        for line_no, raw in _lines(stream):
            if raw is not None and not raw.strip():
                continue
            parsed = _parse_line(raw, line_no, input_field)
            if isinstance(parsed, LineProblem) or _id_hash(parsed.custom_id) not in suspects:
                continue
            first = first_seen.setdefault(parsed.custom_id, line_no)
            if first != line_no:
                check.records -= 1
                message = f"duplicate custom_id {parsed.custom_id!r} (first on line {first})"
                check.add_problem(LineProblem(line_no, message), max_problems=max_problems)
    check.problems.sort(key=lambda problem: problem.line)


def check_jsonl(reopen: Callable[[], BinaryIO], *, input_field: str, max_problems: int = 100) -> JsonlCheck:
    """Read a whole input once (twice if ids may collide) and report every problem."""
    check = JsonlCheck()
    with reopen() as stream:
        for _ in iter_jsonl(stream, input_field=input_field, check=check, max_problems=max_problems):
            pass
    suspects = colliding_id_hashes(check)
    if suspects:
        find_duplicate_ids(reopen, input_field=input_field, check=check, suspects=suspects, max_problems=max_problems)
    return check
