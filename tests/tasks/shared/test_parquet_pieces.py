"""Shards' Parquet pieces, concatenated, give the file the JSONL path gives from the same rows: its schema,
rows and row groups."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.shared.formats.parquet_output import ParquetOutputError, jsonl_to_parquet
from tasks.shared.formats.parquet_pieces import PiecesDisagree, PieceSource, PieceWriter, merge_pieces

JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
"""How the shard writes its JSONL lines."""


def _embedding(n: int, dim: int = 8) -> dict[str, Any]:
    vector = np.random.default_rng(n).standard_normal(dim).astype(np.float32)
    return {"custom_id": f"r{n}", "response": {"embedding": vector, "usage": {"prompt_tokens": n}}}


def _error(n: int) -> dict[str, Any]:
    return {"custom_id": f"r{n}", "error": {"code": "bad_input", "message": f"r{n} failed"}}


def _piece(rows: list[dict[str, Any]], *, task: str = "embed", rows_per_group: int = 7) -> bytes:
    sink = io.BytesIO()
    writer = PieceWriter(sink, task=task, rows_per_group=rows_per_group)
    for row in rows:
        writer.add(row)
    writer.close()
    return sink.getvalue()


def _old_path(shards: list[list[dict[str, Any]]], *, task: str = "embed", rows_per_group: int = 16) -> bytes:
    """What the merge wrote before pieces: every value printed to JSON by the shard, parsed back here."""
    lines = [orjson.dumps(row, option=JSON_OPTIONS) for rows in shards for row in rows]
    sink = io.BytesIO()
    jsonl_to_parquet(lines, sink, task=task, rows_per_group=rows_per_group)
    return sink.getvalue()


def _merged(sources: list[PieceSource], *, task: str = "embed", rows_per_group: int = 16) -> bytes:
    sink = io.BytesIO()
    merge_pieces(sources, sink, task=task, rows_per_group=rows_per_group)
    return sink.getvalue()


def _same_file(merged: bytes, converted: bytes) -> bool:
    """The same schema, rows and row groups (pages may be cut elsewhere: they follow the batches written)."""
    files = [pq.ParquetFile(io.BytesIO(data)) for data in (merged, converted)]
    groups = [[f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)] for f in files]
    tables = [f.read() for f in files]
    if groups[0] != groups[1] or tables[0].schema != tables[1].schema:
        return False
    if "embedding" in tables[0].schema.names:
        # NaN is not equal to itself, so the embeddings are compared as arrays that know it.
        columns = [table.column("embedding").combine_chunks() for table in tables]
        values = [np.asarray(column.flatten(), dtype=np.float32) for column in columns]
        if columns[0].is_null() != columns[1].is_null():
            return False
        if not np.array_equal(values[0], values[1], equal_nan=True):
            return False
        tables = [table.drop_columns(["embedding"]) for table in tables]
    return bool(tables[0].equals(tables[1]))


def _sources(pieces: list[bytes]) -> list[PieceSource]:
    return [PieceSource(piece=_opener(data)) for data in pieces]


def _opener(data: bytes) -> Callable[[], AbstractContextManager[BinaryIO]]:
    return lambda: nullcontext(io.BytesIO(data))


def test_pieces_merged_are_the_file_of_the_jsonl_path_across_row_groups() -> None:
    shards = [
        [_error(n) if n % 5 == 0 else _embedding(n) for n in range(0, 37)],
        [_error(n) for n in range(37, 40)],  # a shard of errors only: a piece without an embedding length
        [_error(n) if n % 3 == 0 else _embedding(n) for n in range(40, 90)],
    ]
    merged = _merged(_sources([_piece(rows) for rows in shards]))

    assert _same_file(merged, _old_path(shards))
    metadata = pq.ParquetFile(io.BytesIO(merged)).metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [16] * 5 + [10]
    table = pq.read_table(io.BytesIO(merged))
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 8)
    assert table.column("embedding")[1].as_py() == _embedding(1)["response"]["embedding"].tolist()


def test_without_a_success_in_the_first_row_group_the_merged_embeddings_are_a_variable_list_as_before() -> None:
    shards = [[_error(n) for n in range(20)], [_embedding(n, dim=4) for n in range(20, 30)]]
    merged = _merged(_sources([_piece(rows) for rows in shards]))

    assert _same_file(merged, _old_path(shards))
    assert pq.read_table(io.BytesIO(merged)).schema.field("embedding").type == pa.list_(pa.float32())


def test_shards_that_failed_for_good_come_as_their_error_lines() -> None:
    failed = [_error(n) for n in range(10, 14)]
    shards = [[_embedding(n) for n in range(10)], failed, [_embedding(n) for n in range(14, 20)]]
    lines = [orjson.dumps(row, option=JSON_OPTIONS) for row in failed]
    sources = [*_sources([_piece(shards[0])]), PieceSource(lines=lambda: lines), *_sources([_piece(shards[2])])]

    assert _same_file(_merged(sources), _old_path(shards))


def test_an_infinite_value_becomes_the_nan_the_jsonl_reads_back() -> None:
    row = _embedding(1)
    row["response"]["embedding"][2] = np.inf
    merged = _merged(_sources([_piece([row, _embedding(2)])]))

    assert _same_file(merged, _old_path([[row, _embedding(2)]]))
    assert np.isnan(pq.read_table(io.BytesIO(merged)).column("embedding")[0].as_py()[2])


def test_generated_texts_merge_as_the_jsonl_path_writes_them() -> None:
    def generated(n: int) -> dict[str, Any]:
        usage = {"prompt_tokens": n, "completion_tokens": 2}
        return {"custom_id": f"g{n}", "response": {"text": f"text {n}", "finish_reason": "stop", "usage": usage}}

    shards = [[generated(n) for n in range(9)], [_error(9), generated(10)]]
    pieces = [_piece(rows, task="generate") for rows in shards]

    assert _same_file(_merged(_sources(pieces), task="generate"), _old_path(shards, task="generate"))


def test_pieces_of_different_embedding_lengths_are_refused_for_the_jsonl_path_to_name_the_line() -> None:
    pieces = [_piece([_embedding(0, dim=8)]), _piece([_embedding(1, dim=4)])]

    with pytest.raises(PiecesDisagree, match=r"embeddings of \[4\] values, where earlier ones have 8"):
        _merged(_sources(pieces))


def test_a_piece_refuses_a_record_of_several_texts_as_the_jsonl_path_does() -> None:
    several = {"custom_id": "b", "response": {"embeddings": [np.ones(2, np.float32)], "usage": {"prompt_tokens": 1}}}

    with pytest.raises(ParquetOutputError, match="a record of several texts"):
        _piece([_embedding(0), several])


def test_a_piece_read_from_a_stream_that_cannot_seek_is_copied_aside() -> None:
    shards = [[_embedding(n) for n in range(5)]]
    data = _piece(shards[0])

    @contextmanager
    def unseekable() -> Iterator[BinaryIO]:
        stream = io.BytesIO(data)
        stream.seekable = lambda: False  # type: ignore[method-assign]
        yield stream

    assert _same_file(_merged([PieceSource(piece=unseekable)]), _old_path(shards))


def test_a_damaged_piece_is_refused_for_the_jsonl_path_to_merge() -> None:
    pieces = [_piece([_embedding(0)]), b"PAR1 cut short"]

    with pytest.raises(PiecesDisagree, match="a piece cannot be read"):
        _merged(_sources(pieces))
