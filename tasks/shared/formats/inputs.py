"""Every job input format as one stream of records: JSONL, CSV, TSV and Parquet, optionally gzip or zstd.

The format is the job's `format` option, else the file name's extension, else the content's magic
bytes (Parquet), else JSONL; the compression is the content's magic bytes, else the name's. Each
format yields the same `Record`s, `{"custom_id", <input field>}` at least, and numbered problems,
with bounded memory: text formats are read a line at a time with a length limit, Parquet a batch
of rows at a time. Counting, the problems' cap and the duplicate-id search are those of
`tasks.shared.formats.jsonl`, so one `JsonlCheck` serves every format.
"""

from __future__ import annotations

import csv
import io
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO, Any, BinaryIO
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.shared.formats.compression import (
    COMPRESSION_SUFFIXES,
    CORRUPT,
    DecompressionLimits,
    corrupt_message,
    decompressed,
    peek,
    sniffed_compression,
)
from tasks.shared.formats.jsonl import (
    MAX_LINE_BYTES,
    JsonlCheck,
    RecordProblem,
    RowProblem,
    colliding_id_hashes,
    count_records,
    mark_duplicates,
    parse_line,
    read_lines,
)
from tasks.shared.formats.parquet_input import (
    ExpansionMeter,
    batch_values,
    check_declared_sizes,
    encoded_columns,
    is_messages,
    is_string,
    row_bytes,
)
from tasks.shared.formats.records import TASK_INPUT_FIELDS, LineProblem, Record

FORMATS = ("auto", "jsonl", "csv", "tsv", "parquet")
COLUMN_FORMATS = ("csv", "tsv", "parquet")
MAX_LINE_CHARS = MAX_LINE_BYTES
"""The longest CSV/TSV line, and the longest field (a quoted field may span lines)."""
PARQUET_BATCH_ROWS = 1024
SPILL_CHUNK_BYTES = 1024 * 1024

_PARQUET_MAGIC = b"PAR1"
_KIND_SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_CHAT_FIELD = TASK_INPUT_FIELDS["chat"]


class InputOptionsError(ValueError):
    """A job's input options are invalid, or do not fit its input; `option` names the option."""

    def __init__(self, message: str, *, option: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class InputFormat:
    """How an input is written."""

    kind: str
    """jsonl, csv, tsv or parquet."""
    compression: str | None
    """gzip, zstd, or None."""


@dataclass(frozen=True)
class InputOptions:
    """How to read a job's input."""

    format: str = "auto"
    """auto, jsonl, csv, tsv or parquet; auto goes by the file name, then by the content."""
    text_column: str | None = None
    """CSV, TSV, Parquet: the column that becomes the record's input field; by default the column
    named like the input field (`input`, `prompt` or `messages`)."""
    id_column: str | None = None
    """CSV, TSV, Parquet: the column that becomes `custom_id`; by default the line (row) number."""

    def __post_init__(self) -> None:
        _check_format(self.format)
        for option in ("text_column", "id_column"):
            value = getattr(self, option)
            if value is not None and (not isinstance(value, str) or not value):
                raise InputOptionsError(f"{option} must be a non-empty column name", option=option)
        if self.format == "jsonl":
            _refuse_columns(self, "format is jsonl")


@dataclass(frozen=True)
class FileProblem(LineProblem):
    """A problem of the whole input (its columns, its compression): numbered 0, shown without a number."""

    def __str__(self) -> str:
        return self.message


def detect_format(uri: str, head: bytes, *, explicit: str = "auto") -> InputFormat:
    """The input's format from `explicit` (a job's `format` option), the name in `uri`, or `head`,
    the input's first bytes; compression from the magic bytes in `head`, else from the name."""
    _check_format(explicit)
    suffixes = [suffix.lower() for suffix in PurePosixPath(urlparse(uri).path).suffixes]
    named_compression = COMPRESSION_SUFFIXES.get(suffixes[-1]) if suffixes else None
    if named_compression:
        suffixes.pop()
    named_kind = _KIND_SUFFIXES.get(suffixes[-1]) if suffixes else None
    compression = sniffed_compression(head) or named_compression
    if explicit != "auto":
        kind = explicit
    elif named_kind:
        kind = named_kind
    else:
        kind = "parquet" if head.startswith(_PARQUET_MAGIC) else "jsonl"
    return InputFormat(kind, compression)


def iter_records(
    open_stream: Callable[[], BinaryIO],
    *,
    uri: str,
    options: InputOptions,
    input_field: str,
    check: JsonlCheck,
    max_problems: int = 100,
    limits: DecompressionLimits | None = None,
    record_problem: RecordProblem | None = None,
) -> Iterator[Record]:
    """Yield valid records in input order; problems are counted into `check`, not yielded (those that
    `record_problem` finds in a well-formed record too).

    Sets `check.unit` to how the input is numbered ("row" for Parquet). Raises InputOptionsError
    (when iterated) if the options do not fit the detected format. Duplicate ids are found after
    the input is exhausted: see `colliding_id_hashes` and `find_duplicate_records`. A compressed input
    is bounded by `limits` (by default the operator's): `DecompressionLimitExceeded` past them.
    """
    with _open_input(open_stream, uri=uri, options=options, input_field=input_field, limits=limits) as (
        input_format,
        items,
    ):
        check.unit = "row" if input_format.kind == "parquet" else "line"
        yield from count_records(items, check=check, max_problems=max_problems, record_problem=record_problem)


def find_duplicate_records(
    open_stream: Callable[[], BinaryIO],
    *,
    uri: str,
    options: InputOptions,
    input_field: str,
    check: JsonlCheck,
    suspects: set[int],
    max_problems: int = 100,
    limits: DecompressionLimits | None = None,
) -> None:
    """Second pass, only after a hash collision: name each record whose custom_id was seen before."""
    with _open_input(open_stream, uri=uri, options=options, input_field=input_field, limits=limits) as (_, items):
        mark_duplicates(items, check=check, suspects=suspects, max_problems=max_problems)


def check_input(
    open_stream: Callable[[], BinaryIO],
    *,
    uri: str,
    options: InputOptions,
    input_field: str,
    max_problems: int = 100,
    limits: DecompressionLimits | None = None,
    record_problem: RecordProblem | None = None,
) -> JsonlCheck:
    """Read a whole input once (twice if ids may collide) and report every problem."""
    check = JsonlCheck()
    for _ in iter_records(
        open_stream,
        uri=uri,
        options=options,
        input_field=input_field,
        check=check,
        max_problems=max_problems,
        limits=limits,
        record_problem=record_problem,
    ):
        pass
    suspects = colliding_id_hashes(check)
    if suspects:
        find_duplicate_records(
            open_stream,
            uri=uri,
            options=options,
            input_field=input_field,
            check=check,
            suspects=suspects,
            max_problems=max_problems,
            limits=limits,
        )
    return check


def _check_format(value: str) -> None:
    if value not in FORMATS:
        raise InputOptionsError(f"format must be one of {', '.join(FORMATS)}, not {value!r}", option="format")


def _refuse_columns(options: InputOptions, why: str) -> None:
    for option in ("text_column", "id_column"):
        if getattr(options, option) is not None:
            raise InputOptionsError(
                f"{option} applies to {', '.join(COLUMN_FORMATS)} inputs, not to jsonl ({why})", option=option
            )


@contextmanager
def _open_input(
    open_stream: Callable[[], BinaryIO],
    *,
    uri: str,
    options: InputOptions,
    input_field: str,
    limits: DecompressionLimits | None,
) -> Iterator[tuple[InputFormat, Iterator[Record | LineProblem]]]:
    with open_stream() as raw:
        head, stream = peek(raw)
        input_format = detect_format(uri, head, explicit=options.format)
        if input_format.kind == "jsonl":
            _refuse_columns(options, f"detected for {uri}")
        yield input_format, _items(input_format, stream, head, options, input_field, limits)


def _items(
    input_format: InputFormat,
    stream: IO[bytes],
    head: bytes,
    options: InputOptions,
    input_field: str,
    limits: DecompressionLimits | None,
) -> Iterator[Record | LineProblem]:
    plain = decompressed(stream, input_format.compression, head, limits)
    if input_format.kind == "parquet":
        spill = input_format.compression is not None or not stream.seekable()
        return _parquet_items(
            plain,
            spill=spill,
            options=options,
            input_field=input_field,
            limits=limits or DecompressionLimits.configured(),
        )
    if input_format.kind == "jsonl":
        return _jsonl_items(plain, input_field)
    delimiter = "," if input_format.kind == "csv" else "\t"
    return _delimited_items(plain, delimiter=delimiter, options=options, input_field=input_field)


def _record(line: int, custom_id: str, input_field: str, value: Any) -> Record:
    if input_field == _CHAT_FIELD and isinstance(value, str):
        # A text column for task chat holds the user's turn of a one-message conversation.
        value = [{"role": "user", "content": value}]
    return Record(line=line, custom_id=custom_id, data={"custom_id": custom_id, input_field: value})


def _missing_columns(present: list[str], options: InputOptions, input_field: str) -> str | None:
    """What is missing from the columns, naming those that exist; None if nothing is."""
    missing = []
    if options.text_column is None and input_field not in present:
        missing.append(f"no column {input_field!r} (set text_column to the column holding the text)")
    elif options.text_column is not None and options.text_column not in present:
        missing.append(f"no text_column {options.text_column!r}")
    if options.id_column is not None and options.id_column not in present:
        missing.append(f"no id_column {options.id_column!r}")
    if not missing:
        return None
    return f"{'; '.join(missing)}; the columns are {', '.join(map(repr, present)) or 'none'}"


# JSONL


def _jsonl_items(stream: IO[bytes], input_field: str) -> Iterator[Record | LineProblem]:
    reached = 0
    try:
        for reached, raw in read_lines(stream):
            if raw is not None and raw.isspace():
                continue
            yield parse_line(raw, reached, input_field)
    except CORRUPT as exc:
        yield LineProblem(reached + 1, corrupt_message(exc))


# CSV and TSV


class _LineTooLong(Exception):
    pass


class _TextLines:
    """The lines of a text stream for `csv.reader`, counted, none longer than MAX_LINE_CHARS."""

    def __init__(self, text: io.TextIOWrapper) -> None:
        self._text = text
        self.count = 0

    def __iter__(self) -> _TextLines:
        return self

    def __next__(self) -> str:
        line = self._text.readline(MAX_LINE_CHARS + 1)
        if not line:
            raise StopIteration
        self.count += 1
        if len(line) > MAX_LINE_CHARS and not line.endswith(("\n", "\r")):
            while (rest := self._text.readline(MAX_LINE_CHARS)) and not rest.endswith(("\n", "\r")):
                pass
            raise _LineTooLong
        return line


def _delimited_rows(stream: IO[bytes], delimiter: str) -> Iterator[tuple[int, list[str]] | LineProblem]:
    """Non-blank rows with the line they start on, or problems; a corrupt input ends them."""
    if csv.field_size_limit() < MAX_LINE_CHARS:
        # The default limit (128 Ki characters) is short for a prompt; the limit keeps a runaway
        # quoted field from holding the rest of the input.
        csv.field_size_limit(MAX_LINE_CHARS)
    # Undecodable bytes become lone surrogates, so that one bad row is named and the rest still read.
    lines = _TextLines(io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline=""))
    reader = csv.reader(lines, delimiter=delimiter)
    name = "CSV" if delimiter == "," else "TSV"
    while True:
        start = lines.count + 1
        try:
            row = next(reader, None)
        except _LineTooLong:
            yield LineProblem(lines.count, f"line is longer than {MAX_LINE_CHARS} characters")
            continue
        except csv.Error as exc:
            yield LineProblem(start, f"not valid {name} ({exc})")
            continue
        except CORRUPT as exc:
            yield LineProblem(start, corrupt_message(exc))
            return
        if row is None:
            return
        if not row:
            continue
        try:
            "".join(row).encode()
        except UnicodeEncodeError:
            yield LineProblem(start, "not valid UTF-8")
            continue
        yield start, row


def _delimited_items(
    stream: IO[bytes], *, delimiter: str, options: InputOptions, input_field: str
) -> Iterator[Record | LineProblem]:
    rows = _delimited_rows(stream, delimiter)
    header: list[str] | None = None
    for item in rows:
        if isinstance(item, LineProblem):
            yield item  # without its header, no row can be read
            return
        header_line, header = item
        break
    if header is None:
        return
    missing = _missing_columns(header, options, input_field)
    if missing:
        yield LineProblem(header_line, missing)
        return
    text_column = options.text_column or input_field
    text_at = header.index(text_column)
    id_at = header.index(options.id_column) if options.id_column is not None else None
    for item in rows:
        if isinstance(item, LineProblem):
            yield item
            continue
        line, row = item
        if len(row) != len(header):
            yield LineProblem(line, f"expected {len(header)} fields like the header, got {len(row)}")
        elif not row[text_at]:
            yield LineProblem(line, f"empty text in column {text_column!r}")
        elif id_at is not None and not row[id_at]:
            yield LineProblem(line, f"empty custom_id in column {options.id_column!r}")
        else:
            custom_id = row[id_at] if id_at is not None else str(line)
            yield _record(line, custom_id, input_field, row[text_at])


# Parquet


def _parquet_items(
    stream: IO[bytes], *, spill: bool, options: InputOptions, input_field: str, limits: DecompressionLimits
) -> Iterator[Record | LineProblem]:
    if not spill:
        yield from _read_parquet(stream, options, input_field, limits)
        return
    # Parquet is read from its footer backwards; an S3 body or a decompressed stream cannot seek,
    # so it is first copied, streaming, to a temporary file: no larger than the decompression limits.
    with tempfile.TemporaryFile(prefix="batchery-input-") as copy:
        try:
            shutil.copyfileobj(stream, copy, SPILL_CHUNK_BYTES)
        except CORRUPT as exc:
            yield FileProblem(0, corrupt_message(exc))
            return
        copy.seek(0)
        yield from _read_parquet(copy, options, input_field, limits)


def _read_parquet(
    source: IO[bytes], options: InputOptions, input_field: str, limits: DecompressionLimits
) -> Iterator[Record | LineProblem]:
    try:
        file_bytes = source.seek(0, io.SEEK_END)
        source.seek(0)
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as exc:
        yield FileProblem(0, f"not a readable Parquet file ({exc})")
        return
    schema = parquet.schema_arrow
    missing = _missing_columns(schema.names, options, input_field)
    if missing:
        yield FileProblem(0, missing)
        return
    text_column = options.text_column or input_field
    text_type = schema.field(text_column).type
    text_fits = is_string(text_type) or (input_field == _CHAT_FIELD and is_messages(text_type))
    wanted = "a string or a list of messages" if input_field == _CHAT_FIELD else "a string"
    wrong_text = None if text_fits else f"text in column {text_column!r} is {text_type}, not {wanted}"
    id_column = options.id_column
    wrong_id = None
    if id_column is not None:
        id_type = schema.field(id_column).type
        if not (is_string(id_type) or pa.types.is_integer(id_type)):
            wrong_id = f"custom_id in column {id_column!r} is {id_type}, not a string or an integer"
    columns = list(dict.fromkeys(name for name in (text_column, id_column) if name is not None))
    check_declared_sizes(parquet, columns, limits=limits)
    meter = ExpansionMeter(limits=limits, file_bytes=file_bytes)
    row = 0
    try:
        # Dictionaries stay encoded until a row is taken: decoded whole, a small file could fill memory.
        parquet = pq.ParquetFile(source, metadata=parquet.metadata, read_dictionary=encoded_columns(parquet, columns))
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            text_array = batch.column(text_column)
            sizes = row_bytes(text_array)
            if id_column is not None and id_column != text_column:
                sizes = sizes + row_bytes(batch.column(id_column))
            meter.add(sizes, first_row=row + 1)
            oversized = set(meter.oversized(sizes))
            texts = batch_values(text_array, oversized)
            ids = batch_values(batch.column(id_column), oversized) if id_column is not None else None
            for offset, text in enumerate(texts):
                row += 1
                custom_id = str(row) if ids is None else ids[offset]
                if offset in oversized:
                    yield RowProblem(row, meter.row_problem(int(sizes[offset]), text_column))
                elif text is None:
                    yield RowProblem(row, f"null text in column {text_column!r}")
                elif wrong_text:
                    yield RowProblem(row, wrong_text)
                elif text in ("", []):
                    yield RowProblem(row, f"empty text in column {text_column!r}")
                elif custom_id is None:
                    yield RowProblem(row, f"null custom_id in column {id_column!r}")
                elif wrong_id:
                    yield RowProblem(row, wrong_id)
                elif custom_id == "":
                    yield RowProblem(row, f"empty custom_id in column {id_column!r}")
                else:
                    yield _record(row, str(custom_id), input_field, text)
    except (pa.ArrowException, OSError) as exc:
        yield RowProblem(row + 1, f"the Parquet file cannot be read from here on ({exc})")
