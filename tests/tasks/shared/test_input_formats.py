"""Every input format gives the same records and names its problems by line (row, for Parquet)."""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tasks.shared.formats import inputs
from tasks.shared.formats.inputs import (
    FileProblem,
    InputFormat,
    InputOptions,
    InputOptionsError,
    check_input,
    detect_format,
    iter_records,
)
from tasks.shared.formats.jsonl import JsonlCheck

ROWS = [
    ("a", "plain text"),
    ("b", 'commas, "quotes"\tand a tab'),
    ("c", "two\nlines"),
    ("d", "ünïcødé ✓"),
]
COLUMNS = InputOptions(text_column="text", id_column="id")
DEFAULTS = InputOptions()


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _delimited(rows: list[tuple[str, str]], *, delimiter: str = ",", header: tuple[str, ...] = ("id", "text")) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, delimiter=delimiter, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return text.getvalue().encode()


def _parquet(columns: dict[str, Any], *, row_group_size: int | None = None) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink, row_group_size=row_group_size)
    return sink.getvalue()


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _opener(path: Path) -> Callable[[], BinaryIO]:
    return lambda: path.open("rb")


def _read(
    path: Path, options: InputOptions = DEFAULTS, *, input_field: str = "input"
) -> tuple[list[tuple[str, Any]], JsonlCheck]:
    check = JsonlCheck()
    records = iter_records(_opener(path), uri=path.as_uri(), options=options, input_field=input_field, check=check)
    return [(record.custom_id, record.data[input_field]) for record in records], check


def _check(path: Path, options: InputOptions = DEFAULTS, *, input_field: str = "input") -> JsonlCheck:
    return check_input(_opener(path), uri=path.as_uri(), options=options, input_field=input_field, max_problems=50)


class _Unseekable(io.RawIOBase):
    """A body that can only be read forward, like an S3 object's."""

    def __init__(self, data: bytes) -> None:
        super().__init__()
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._data.readinto(buffer)


def _sources() -> dict[str, tuple[bytes, InputOptions]]:
    jsonl = _jsonl([{"custom_id": custom_id, "input": text} for custom_id, text in ROWS])
    csv_data = _delimited(ROWS)
    return {
        "input.jsonl": (jsonl, InputOptions()),
        "input.csv": (csv_data, COLUMNS),
        "input.tsv": (_delimited(ROWS, delimiter="\t"), COLUMNS),
        "input.parquet": (_parquet({"id": [r[0] for r in ROWS], "text": [r[1] for r in ROWS]}), COLUMNS),
        "input.jsonl.gz": (gzip.compress(jsonl), InputOptions()),
        "input.csv.zst": (zstandard.ZstdCompressor().compress(csv_data), COLUMNS),
    }


@pytest.mark.parametrize("name", list(_sources()))
def test_every_format_gives_the_same_records(tmp_path: Path, name: str) -> None:
    data, options = _sources()[name]
    records, check = _read(_write(tmp_path, name, data), options)
    assert records == ROWS
    assert check.ok
    assert check.records == len(ROWS)


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("file:///data/in.jsonl", InputFormat("jsonl", None)),
        ("s3://bucket/in.json", InputFormat("jsonl", None)),
        ("s3://bucket/in.ndjson.gz", InputFormat("jsonl", "gzip")),
        ("/data/IN.CSV", InputFormat("csv", None)),
        ("file:///data/in.csv.gzip", InputFormat("csv", "gzip")),
        ("file:///data/in.tsv.zst", InputFormat("tsv", "zstd")),
        ("file:///data/in.v2.tsv.zstd", InputFormat("tsv", "zstd")),
        ("file:///data/in.parquet", InputFormat("parquet", None)),
        ("file:///data/in.pq", InputFormat("parquet", None)),
        ("file:///data/in.data", InputFormat("jsonl", None)),
    ],
)
def test_the_format_comes_from_the_name(uri: str, expected: InputFormat) -> None:
    assert detect_format(uri, b"{") == expected


def test_magic_bytes_name_the_compression_and_parquet_and_an_explicit_format_wins() -> None:
    assert detect_format("file:///in.data", b"\x1f\x8b\x08\x00") == InputFormat("jsonl", "gzip")
    assert detect_format("file:///in.csv", b"\x28\xb5\x2f\xfd\x00") == InputFormat("csv", "zstd")
    assert detect_format("file:///in.bin", b"PAR1\x15\x04") == InputFormat("parquet", None)
    assert detect_format("file:///in.jsonl", b"id,text", explicit="csv") == InputFormat("csv", None)
    assert detect_format("file:///in.jsonl.gz", b"\x1f\x8b", explicit="tsv") == InputFormat("tsv", "gzip")


def test_a_gzip_file_named_anything_is_read_as_gzip(tmp_path: Path) -> None:
    jsonl = _jsonl([{"custom_id": custom_id, "input": text} for custom_id, text in ROWS])
    records, check = _read(_write(tmp_path, "input.data", gzip.compress(jsonl)))
    assert records == ROWS
    assert check.ok


def test_an_explicit_format_overrides_the_name(tmp_path: Path) -> None:
    path = _write(tmp_path, "input.jsonl", _delimited(ROWS, delimiter="\t"))
    records, check = _read(path, InputOptions(format="tsv", text_column="text", id_column="id"))
    assert records == ROWS
    assert check.ok


def test_ids_default_to_line_numbers_counting_the_header_and_quoted_newlines(tmp_path: Path) -> None:
    path = _write(tmp_path, "input.csv", b'input\n"one\nspans two lines"\nnext\n\nafter a blank line\n')
    records, check = _read(path)
    assert records == [("2", "one\nspans two lines"), ("4", "next"), ("6", "after a blank line")]
    assert check.ok


def test_parquet_ids_default_to_row_numbers_and_integer_ids_become_strings(tmp_path: Path) -> None:
    path = _write(tmp_path, "input.parquet", _parquet({"key": [10, 20], "input": ["x", "y"]}))
    assert _read(path)[0] == [("1", "x"), ("2", "y")]
    assert _read(path, InputOptions(id_column="key"))[0] == [("10", "x"), ("20", "y")]


def test_bad_csv_rows_are_named_by_the_line_they_start_on(tmp_path: Path) -> None:
    data = (
        b'id,text\na,"a quoted field\nover two lines"\nb,\nc,x,extra\n,y\n'
        b'd,bad \xff\xfe bytes\n"e","fine, in the end"\n'
    )
    path = _write(tmp_path, "input.csv", data)
    records, check = _read(path, COLUMNS)
    assert records == [("a", "a quoted field\nover two lines"), ("e", "fine, in the end")]
    assert [str(problem) for problem in check.problems] == [
        "line 4: empty text in column 'text'",
        "line 5: expected 2 fields like the header, got 3",
        "line 6: empty custom_id in column 'id'",
        "line 7: not valid UTF-8",
    ]
    assert check.summary(limit=1) == "4 bad lines: line 4: empty text in column 'text'; and 3 more bad lines"


def test_a_csv_line_longer_than_the_limit_is_named_and_reading_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inputs, "MAX_LINE_CHARS", 64)
    path = _write(tmp_path, "input.csv", b"input\nshort\n" + b"x" * 500 + b"\nafter\n")
    records, check = _read(path)
    assert records == [("2", "short"), ("4", "after")]
    assert [str(problem) for problem in check.problems] == ["line 3: line is longer than 64 characters"]


def test_missing_columns_are_one_problem_naming_the_columns_there(tmp_path: Path) -> None:
    path = _write(tmp_path, "input.csv", _delimited(ROWS, header=("key", "body")))
    records, check = _read(path)
    assert records == []
    assert [str(problem) for problem in check.problems] == [
        "line 1: no column 'input' (set text_column to the column holding the text); the columns are 'key', 'body'"
    ]

    parquet = _write(tmp_path, "input.parquet", _parquet({"key": ["a"], "body": ["x"]}))
    records, check = _read(parquet, InputOptions(text_column="text", id_column="id"))
    assert records == []
    assert check.problem_count == 1
    assert isinstance(check.problems[0], FileProblem)
    summary = check.summary(limit=5)
    assert summary == "1 bad row: no text_column 'text'; no id_column 'id'; the columns are 'key', 'body'"


def test_parquet_rows_with_null_empty_or_mistyped_values_are_named_by_row(tmp_path: Path) -> None:
    path = _write(tmp_path, "input.parquet", _parquet({"id": ["a", None, "c", "d"], "input": ["x", "y", None, ""]}))
    records, check = _read(path, InputOptions(id_column="id"))
    assert records == [("a", "x")]
    assert [str(problem) for problem in check.problems] == [
        "row 2: null custom_id in column 'id'",
        "row 3: null text in column 'input'",
        "row 4: empty text in column 'input'",
    ]

    numbers = _write(tmp_path, "numbers.parquet", _parquet({"input": [1, 2]}))
    records, check = _read(numbers)
    assert records == []
    assert [str(problem) for problem in check.problems] == [
        "row 1: text in column 'input' is int64, not a string",
        "row 2: text in column 'input' is int64, not a string",
    ]


def test_chat_takes_a_parquet_list_of_messages_or_a_text_as_the_users_turn(tmp_path: Path) -> None:
    messages = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    path = _write(tmp_path, "chat.parquet", _parquet({"messages": messages}))
    assert _read(path, input_field="messages")[0] == [("1", messages[0])]

    text = _write(tmp_path, "chat.csv", b"id,question\nq1,why?\n")
    options = InputOptions(text_column="question", id_column="id")
    assert _read(text, options, input_field="messages")[0] == [("q1", [{"role": "user", "content": "why?"}])]


@pytest.mark.parametrize(
    ("name", "data", "options", "expected"),
    [
        (
            "input.jsonl.gz",
            gzip.compress(_jsonl([{"custom_id": i, "input": "x"} for i in ["a", "b", "a"]]), mtime=0),
            InputOptions(),
            "line 3: duplicate custom_id 'a' (first on line 1)",
        ),
        (
            "input.csv",
            _delimited([("a", "x"), ("b", "y"), ("a", "z")]),
            COLUMNS,
            "line 4: duplicate custom_id 'a' (first on line 2)",
        ),
        (
            "input.parquet",
            _parquet({"id": ["a", "b", "a"], "text": ["x", "y", "z"]}),
            COLUMNS,
            "row 3: duplicate custom_id 'a' (first on row 1)",
        ),
    ],
)
def test_duplicate_ids_are_found_in_every_format(
    tmp_path: Path, name: str, data: bytes, options: InputOptions, expected: str
) -> None:
    check = _check(_write(tmp_path, name, data), options)
    assert [str(problem) for problem in check.problems] == [expected]
    assert check.records == 2


def test_a_truncated_gzip_input_is_a_problem_at_the_line_reached(tmp_path: Path) -> None:
    data = gzip.compress(_jsonl([{"input": f"record {n} " + "x" * 50} for n in range(2000)]))
    records, check = _read(_write(tmp_path, "input.jsonl.gz", data[: len(data) // 2]))
    assert 0 < len(records) < 2000
    assert check.problem_count == 1
    problem = check.problems[0]
    assert problem.line == len(records) + 1
    assert "compressed input is corrupt" in str(check.problems[-1])


def test_corrupt_and_truncated_zstd_inputs_are_problems(tmp_path: Path) -> None:
    garbage = _write(tmp_path, "garbage.csv.zst", b"\x28\xb5\x2f\xfd" + b"not zstd at all" * 10)
    records, check = _read(garbage, COLUMNS)
    assert records == []
    assert str(check.problems[0]).startswith("line 1: the compressed input is corrupt")

    csv_data = _delimited([(f"id-{n}", f"text {n}") for n in range(3000)])
    data = zstandard.ZstdCompressor().compress(csv_data)
    records, check = _read(_write(tmp_path, "cut.csv.zst", data[:-20]), COLUMNS)
    assert len(records) < 3000
    assert "compressed input is corrupt" in str(check.problems[-1])


def test_openai_batch_request_lines_are_job_input(tmp_path: Path) -> None:
    lines = [
        {"custom_id": "r1", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hello"}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m"}},
        {"custom_id": "r3", "input": "plain"},
    ]
    path = _write(tmp_path, "requests.jsonl", _jsonl(lines))
    check = JsonlCheck()
    records = list(iter_records(_opener(path), uri=path.as_uri(), options=DEFAULTS, input_field="input", check=check))
    assert [record.data for record in records] == [
        {"custom_id": "r1", "input": "hello"},
        {"custom_id": "r3", "input": "plain"},
    ]
    assert [str(problem) for problem in check.problems] == [
        "line 2: missing field 'input', at the top level and in 'body'"
    ]


def test_invalid_options_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(InputOptionsError, match="format must be one of") as raised:
        InputOptions(format="xml")
    assert raised.value.option == "format"
    with pytest.raises(InputOptionsError, match="text_column applies to csv, tsv, parquet inputs") as raised:
        InputOptions(format="jsonl", text_column="text")
    assert raised.value.option == "text_column"
    with pytest.raises(InputOptionsError, match="id_column must be a non-empty"):
        InputOptions(id_column="")

    path = _write(tmp_path, "input.jsonl", _jsonl([{"input": "x"}]))
    with pytest.raises(InputOptionsError, match=r"id_column .* not to jsonl \(detected for file://") as raised:
        _read(path, InputOptions(id_column="id"))
    assert raised.value.option == "id_column"


def test_a_file_named_parquet_that_is_not_is_one_problem(tmp_path: Path) -> None:
    records, check = _read(_write(tmp_path, "input.parquet", b"PAR1 but nothing more"))
    assert records == []
    assert check.problem_count == 1
    assert str(check.problems[0]).startswith("not a readable Parquet file")


def test_a_large_parquet_input_is_read_a_batch_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = 40_000
    texts = [f"{n:08d} " + "x" * 1000 for n in range(rows)]
    path = _write(tmp_path, "big.parquet", _parquet({"input": texts}, row_group_size=1000))
    del texts
    table_bytes = rows * 1000

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the whole table must not be read")

    monkeypatch.setattr(pq, "read_table", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read", refuse)
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", refuse)
    batch_sizes: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self: pq.ParquetFile, *args: Any, **kwargs: Any) -> Any:
        batch_sizes.append(kwargs["batch_size"])
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    baseline = pa.total_allocated_bytes()
    peak = 0
    count = 0
    check = JsonlCheck()
    for record in iter_records(
        _opener(path), uri=path.as_uri(), options=InputOptions(), input_field="input", check=check
    ):
        count += 1
        assert record.custom_id == str(count)
        peak = max(peak, pa.total_allocated_bytes() - baseline)
    assert count == rows
    assert check.ok
    assert batch_sizes == [inputs.PARQUET_BATCH_ROWS]
    # About a row group's pages and a batch's dictionaries (kept encoded, `parquet_input`): an eighth here.
    assert peak < table_bytes / 6


def test_a_parquet_input_that_cannot_seek_is_copied_to_a_temporary_file_first(tmp_path: Path) -> None:
    data = _parquet({"id": [r[0] for r in ROWS], "text": [r[1] for r in ROWS]})
    check = JsonlCheck()
    records = iter_records(
        lambda: io.BufferedReader(_Unseekable(data)),  # type: ignore[arg-type, return-value]
        uri="s3://bucket/input.parquet",
        options=COLUMNS,
        input_field="input",
        check=check,
    )
    assert [(record.custom_id, record.data["input"]) for record in records] == ROWS

    compressed = _write(tmp_path, "input.parquet.gz", gzip.compress(data))
    assert _read(compressed, COLUMNS)[0] == ROWS


def test_an_unseekable_text_input_keeps_its_first_bytes(tmp_path: Path) -> None:
    data = gzip.compress(_delimited(ROWS))
    check = JsonlCheck()
    records = iter_records(
        lambda: io.BufferedReader(_Unseekable(data)),  # type: ignore[arg-type, return-value]
        uri="s3://bucket/export",
        options=InputOptions(format="csv", text_column="text", id_column="id"),
        input_field="input",
        check=check,
    )
    assert [(record.custom_id, record.data["input"]) for record in records] == ROWS


def test_an_empty_csv_has_no_records_and_no_problems(tmp_path: Path) -> None:
    check = _check(_write(tmp_path, "input.csv", b""))
    assert check.ok
    assert check.records == 0
