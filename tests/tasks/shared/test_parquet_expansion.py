"""A Parquet input cannot expand past the decompression limits through its own compression or its
dictionaries: the footer's uncompressed sizes are checked before a row is read, dictionaries stay encoded,
each row's decoded size is held to BATCHERY_MAX_PARQUET_ROW_BYTES, and the rows together to the limits."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.shared.formats.compression import DecompressionLimitExceeded, DecompressionLimits
from tasks.shared.formats.inputs import InputOptions, iter_records
from tasks.shared.formats.jsonl import JsonlCheck
from tests.support.bombs import MiB

NO_RATIO = 1e12


def _write(path: Path, columns: dict[str, Any], **options: Any) -> Path:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink, **options)
    path.write_bytes(sink.getvalue())
    return path


def _read(
    path: Path, limits: DecompressionLimits, *, input_field: str = "input", options: InputOptions | None = None
) -> tuple[list[str], JsonlCheck]:
    check = JsonlCheck()
    records = iter_records(
        lambda: path.open("rb"),
        uri=path.as_uri(),
        options=options or InputOptions(),
        input_field=input_field,
        check=check,
        limits=limits,
    )
    return [record.custom_id for record in records], check


def test_a_dictionary_of_one_large_text_used_by_every_row_stops_at_the_size_limit_naming_the_rows(
    tmp_path: Path,
) -> None:
    # About 1 MiB on disk (one dictionary entry, then indices); decoded, 300 MiB.
    path = _write(tmp_path / "bomb.parquet", {"input": ["x" * MiB] * 300}, compression="zstd")
    assert path.stat().st_size < 2 * MiB

    with pytest.raises(DecompressionLimitExceeded, match=r"decodes to more than 33554432 bytes \(by rows 1-") as raised:
        _read(path, DecompressionLimits(max_bytes=32 * MiB, max_ratio=NO_RATIO))
    assert raised.value.setting == "BATCHERY_MAX_DECOMPRESSED_BYTES"

    ratio = DecompressionLimits(max_bytes=1 << 40, max_ratio=20, ratio_after=4 * MiB)
    with pytest.raises(DecompressionLimitExceeded, match="expands more than 20 times as it is decoded") as raised:
        _read(path, ratio)
    assert raised.value.setting == "BATCHERY_MAX_COMPRESSION_RATIO"


def test_pages_that_uncompress_past_the_limit_are_refused_from_the_footer_before_a_row_is_read(
    tmp_path: Path,
) -> None:
    texts = [f"{n:06d}" + "a" * 4096 for n in range(4096)]  # 16 MiB of text, a few hundred KB compressed
    path = _write(tmp_path / "pages.parquet", {"input": texts}, compression="zstd", use_dictionary=False)
    assert path.stat().st_size < MiB
    read: list[str] = []
    check = JsonlCheck()
    records = iter_records(
        lambda: path.open("rb"),
        uri=path.as_uri(),
        options=InputOptions(),
        input_field="input",
        check=check,
        limits=DecompressionLimits(max_bytes=4 * MiB, max_ratio=NO_RATIO),
    )
    with pytest.raises(DecompressionLimitExceeded, match=r"pages uncompress to more than 4194304 bytes \(row group 1"):
        read.extend(record.custom_id for record in records)
    assert read == [], "refused before a row is read"


def test_a_row_over_its_cap_is_named_by_row_and_column_and_the_other_rows_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_PARQUET_ROW_BYTES", str(MiB))
    path = _write(tmp_path / "rows.parquet", {"id": ["a", "b", "c"], "body": ["short", "y" * (2 * MiB), "fine"]})
    limits = DecompressionLimits(max_bytes=1 << 40, max_ratio=NO_RATIO)

    ids, check = _read(path, limits, options=InputOptions(text_column="body", id_column="id"))

    assert ids == ["a", "c"]
    assert [str(problem) for problem in check.problems] == [
        f"row 2: the row holds {2 * MiB + 1} bytes in column 'body', more than the {MiB} a row may hold "
        "(BATCHERY_MAX_PARQUET_ROW_BYTES)"
    ]


def test_a_chats_messages_count_every_message_against_the_rows_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_PARQUET_ROW_BYTES", str(MiB))
    many = [{"role": "user", "content": "z" * (MiB // 4)}] * 8  # eight small messages, 2 MiB together
    path = _write(tmp_path / "chat.parquet", {"messages": [[{"role": "user", "content": "hi"}], many]})

    ids, check = _read(path, DecompressionLimits(max_bytes=1 << 40, max_ratio=NO_RATIO), input_field="messages")

    assert ids == ["1"]
    assert [problem.line for problem in check.problems] == [2]
    assert "in column 'messages', more than the 1048576 a row may hold" in str(check.problems[0])
