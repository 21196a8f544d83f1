"""JSONL input: stream records one line at a time, checking each, with bounded memory.

A line is read with a length limit, so one enormous line cannot exhaust memory. Duplicate
`custom_id`s are found without keeping the ids: their 64-bit hashes go to `IdHashes`, which spills
to disk past a few MB and finds repeats bucket by bucket. Only if two hashes collide is the input
read a second time, keeping just the ids whose hash collided, to name the duplicate lines exactly.

The check, the counting and the duplicate search also serve the other input formats
(`tasks.shared.formats.inputs`), whose records are numbered by line (CSV, TSV) or by row (Parquet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, BinaryIO

import orjson

from gpuworkers.engines.base import ADAPTER_PARAM
from gpuworkers.engines.request_params import ADAPTER_NOT_A_PARAM, PLATFORM_FIELDS
from gpuworkers.engines.sampling import SchemaRefused
from gpuworkers.engines.tools import check_reply_schema_bounds
from tasks.shared.formats.id_hashes import IdHashes
from tasks.shared.formats.records import REFUSED_FIELD, LineProblem, Record, input_problem

MAX_LINE_BYTES = 16 * 1024 * 1024
_UINT64 = (1 << 64) - 1


def id_hash(custom_id: str) -> int:
    """The 64-bit hash the duplicate-id check keeps for a custom_id.

    Python's own string hash (SipHash, 64 bits here): a str caches it, so it costs next to nothing
    a record. Its seed differs between processes, which is fine: an input's first pass and its
    duplicate search always run in the same process."""
    return hash(custom_id) & _UINT64


def read_lines(stream: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
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


def parse_line(raw: bytes | None, line_no: int, input_field: str) -> Record | LineProblem:
    """One line as a record, or what is wrong with it.

    A line of an OpenAI batch request file (`{"custom_id", "method", "url", "body": {...}}`) whose
    input field is only inside `body` becomes the record `{custom_id, <input field>}`. A native record may
    carry ``params`` of its own, a JSON object over the job's params for that record alone, and ``model``, the
    name of the model it runs with (its job's, or an adapter of it: `portal.jobs.adapters` judges which). A record
    that carries `REFUSED_FIELD` is kept as its custom_id and refusal alone: it is not run, and its output line is
    its refusal.
    """
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
    if REFUSED_FIELD in data:
        refused = data[REFUSED_FIELD]
        if not isinstance(refused, str) or not refused:
            return LineProblem(line_no, f"{REFUSED_FIELD} must be a non-empty string: why the record cannot run")
        # Nothing else of it is read: it does not run.
        return Record(line=line_no, custom_id=custom_id, data={"custom_id": custom_id, REFUSED_FIELD: refused})
    if input_field not in data:
        body = data.get("body")
        if not isinstance(body, dict):
            return LineProblem(line_no, f"missing field {input_field!r}")
        if input_field not in body:
            return LineProblem(line_no, f"missing field {input_field!r}, at the top level and in 'body'")
        data = {input_field: body[input_field]}
    if (problem := input_problem(input_field, data[input_field])) is not None:
        return LineProblem(line_no, problem)
    if (problem := _record_params_problem(data.get("params"))) is not None:
        return LineProblem(line_no, problem)
    if "model" in data and (not isinstance(data["model"], str) or not data["model"]):
        return LineProblem(line_no, "model must be a non-empty string: the job's model or an adapter of it")
    data["custom_id"] = custom_id
    return Record(line=line_no, custom_id=custom_id, data=data)


def _record_params_problem(params: object) -> str | None:
    """What is wrong with a record's own ``params``, if anything; the engine judges the fields when it runs."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return f"params must be a JSON object, got {type(params).__name__}"
    if ADAPTER_PARAM in params:
        return f"params.{ADAPTER_NOT_A_PARAM}"
    platform = sorted(PLATFORM_FIELDS & params.keys())
    if platform:
        # Shards are cut and timed by the job's params; one record cannot change them.
        return f"params.{platform[0]} applies to the whole job and cannot be set on one record"
    try:
        # A schema is compiled on a shared slot: one over the bounds is refused here, not met there.
        check_reply_schema_bounds(params)
    except SchemaRefused as exc:
        return f"params.{exc}"
    return None


def parse_jsonl(stream: BinaryIO, *, input_field: str) -> Iterator[Record | LineProblem]:
    """Every non-blank line as a record or a problem; blank lines still count towards line numbers."""
    for line_no, raw in read_lines(stream):
        if raw is not None and raw.isspace():
            continue
        yield parse_line(raw, line_no, input_field)


@dataclass(frozen=True)
class RowProblem(LineProblem):
    """One bad row of a columnar input (Parquet); `line` holds its 1-based row number."""

    def __str__(self) -> str:
        return f"row {self.line}: {self.message}"


@dataclass
class JsonlCheck:
    """The outcome of reading a whole input: counts and the first problems found."""

    records: int = 0
    problems: list[LineProblem] = field(default_factory=list)
    problem_count: int = 0
    id_hashes: IdHashes = field(default_factory=IdHashes, repr=False)
    """64-bit hashes of every valid record's custom_id, in bounded memory."""
    unit: str = "line"
    """What the input's records are numbered by: "line" (text formats) or "row" (Parquet)."""

    @property
    def ok(self) -> bool:
        """No bad line; an input without records is fine (its job ends with an empty output)."""
        return self.problem_count == 0

    def summary(self, *, limit: int) -> str:
        shown = "; ".join(str(p) for p in self.problems[:limit])
        more = self.problem_count - min(limit, len(self.problems))
        suffix = f"; and {more} more bad {self.unit}{'s' if more != 1 else ''}" if more > 0 else ""
        return f"{self.problem_count} bad {self.unit}{'s' if self.problem_count != 1 else ''}: {shown}{suffix}"

    def problem(self, number: int, message: str) -> LineProblem:
        """A problem numbered in this input's unit."""
        return RowProblem(number, message) if self.unit == "row" else LineProblem(number, message)

    def add_problem(self, problem: LineProblem, *, max_problems: int) -> None:
        self.problem_count += 1
        if len(self.problems) < max_problems:
            self.problems.append(problem)


def iter_jsonl(stream: BinaryIO, *, input_field: str, check: JsonlCheck, max_problems: int = 100) -> Iterator[Record]:
    """Yield valid records in input order; bad lines are counted into `check`, not yielded.

    Blank lines are skipped but still count towards line numbers. Duplicate ids are found after
    the stream is exhausted: see `colliding_id_hashes` and `find_duplicate_ids`.
    """
    return count_records(parse_jsonl(stream, input_field=input_field), check=check, max_problems=max_problems)


RecordProblem = Callable[[Record], str | None]
"""What is wrong with a well-formed record that only its reader can judge (the catalog, for the model it
names); None if nothing."""


def count_records(
    items: Iterable[Record | LineProblem],
    *,
    check: JsonlCheck,
    max_problems: int,
    record_problem: RecordProblem | None = None,
) -> Iterator[Record]:
    """Yield the records of `items`; count them, their id hashes and the problems into `check`."""
    for item in items:
        if isinstance(item, Record) and record_problem is not None and (message := record_problem(item)) is not None:
            item = check.problem(item.line, message)
        if isinstance(item, LineProblem):
            check.add_problem(item, max_problems=max_problems)
            continue
        check.id_hashes.append(id_hash(item.custom_id))
        check.records += 1
        yield item


def colliding_id_hashes(check: JsonlCheck) -> set[int]:
    """Hashes shared by two or more records: their ids may be duplicates."""
    return check.id_hashes.repeated()


def find_duplicate_ids(
    reopen: Callable[[], BinaryIO],
    *,
    input_field: str,
    check: JsonlCheck,
    suspects: set[int],
    max_problems: int = 100,
) -> None:
    """Second pass, only after a hash collision: name each line whose custom_id was seen before."""
    with reopen() as stream:
        mark_duplicates(
            parse_jsonl(stream, input_field=input_field), check=check, suspects=suspects, max_problems=max_problems
        )


def mark_duplicates(
    items: Iterable[Record | LineProblem], *, check: JsonlCheck, suspects: set[int], max_problems: int
) -> None:
    """Count a problem for each record whose custom_id (one of the `suspects` hashes) was seen before."""
    first_seen: dict[str, int] = {}
    for item in items:
        if isinstance(item, LineProblem) or id_hash(item.custom_id) not in suspects:
            continue
        first = first_seen.setdefault(item.custom_id, item.line)
        if first != item.line:
            check.records -= 1
            message = f"duplicate custom_id {item.custom_id!r} (first on {check.unit} {first})"
            check.add_problem(check.problem(item.line, message), max_problems=max_problems)
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
