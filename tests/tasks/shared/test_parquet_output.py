"""A job's JSONL output converts to Parquet: typed columns by task, order kept, a row group at a time."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.shared.formats.parquet_output import ParquetOutputError, jsonl_to_parquet


def _lines(rows: list[dict[str, Any]]) -> list[bytes]:
    return [orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE) for row in rows]


def _convert(rows: list[dict[str, Any]], *, task: str, rows_per_group: int = 10_000) -> tuple[int, bytes]:
    sink = io.BytesIO()
    written = jsonl_to_parquet(_lines(rows), sink, task=task, rows_per_group=rows_per_group)
    assert not sink.closed
    return written, sink.getvalue()


def _table(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data))


def _embedding(custom_id: str, vector: list[float], tokens: int) -> dict[str, Any]:
    return {"custom_id": custom_id, "response": {"embedding": vector, "usage": {"prompt_tokens": tokens}}}


def _error(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "error": {"code": "bad_input", "message": f"{custom_id} failed"}}


def test_embeddings_become_a_fixed_size_float32_column() -> None:
    rows = [_embedding("a", [0.5, 1.5, -2.0], 3), _error("b"), _embedding("c", [1.0, 2.0, 3.0], 4)]
    written, parquet = _convert(rows, task="embed")
    table = _table(parquet)
    assert written == 3
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    assert table.schema.field("prompt_tokens").type == pa.int64()
    assert table.column("custom_id").to_pylist() == ["a", "b", "c"]
    assert table.column("error_code").to_pylist() == [None, "bad_input", None]
    assert table.column("error_message").to_pylist() == [None, "b failed", None]
    assert table.column("embedding").to_pylist() == [[0.5, 1.5, -2.0], None, [1.0, 2.0, 3.0]]
    assert table.column("prompt_tokens").to_pylist() == [3, None, 4]


def test_generated_texts_get_their_own_columns() -> None:
    response = {"text": "hi", "finish_reason": "stop", "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    written, parquet = _convert([{"custom_id": "a", "response": response}, _error("b")], task="generate")
    table = _table(parquet)
    assert written == 2
    assert table.schema.names == [
        "custom_id",
        "error_code",
        "error_message",
        "text",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
    ]
    assert table.to_pylist()[0] == {
        "custom_id": "a",
        "error_code": None,
        "error_message": None,
        "text": "hi",
        "finish_reason": "stop",
        "prompt_tokens": 5,
        "completion_tokens": 1,
    }
    assert table.to_pylist()[1]["text"] is None


def test_other_tasks_keep_the_response_as_json_text() -> None:
    response = {"label": "positive", "scores": {"positive": 0.9, "negative": 0.1}}
    _, parquet = _convert([{"custom_id": "a", "response": response}, _error("b")], task="classify")
    table = _table(parquet)
    assert orjson.loads(table.column("response")[0].as_py()) == response
    assert table.column("response")[1].as_py() is None


def test_many_rows_mixing_successes_and_errors_keep_their_order_over_row_groups() -> None:
    rows = [_error(f"id-{n}") if n % 7 == 0 else _embedding(f"id-{n}", [float(n)] * 4, n) for n in range(1, 251)]
    written, parquet = _convert(rows, task="embed", rows_per_group=40)
    assert written == 250
    metadata = pq.ParquetFile(io.BytesIO(parquet)).metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [40] * 6 + [10]
    table = _table(parquet)
    assert table.column("custom_id").to_pylist() == [f"id-{n}" for n in range(1, 251)]
    errors = table.column("error_code").to_pylist()
    assert [n for n, code in enumerate(errors, start=1) if code is not None] == list(range(7, 251, 7))
    assert table.column("embedding")[1].as_py() == [2.0] * 4


def test_without_a_success_in_the_first_row_group_embeddings_are_a_variable_list() -> None:
    _, parquet = _convert([_error("a"), _error("b"), _embedding("c", [1.0, 2.0], 1)], task="embed", rows_per_group=2)
    table = _table(parquet)
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.column("embedding").to_pylist() == [None, None, [1.0, 2.0]]

    written, parquet = _convert([], task="embed")
    assert written == 0
    table = _table(parquet)
    assert table.num_rows == 0
    assert table.schema.field("embedding").type == pa.list_(pa.float32())


def test_an_embedding_of_another_length_is_refused() -> None:
    rows = [_embedding("a", [1.0, 2.0, 3.0], 1), _embedding("b", [1.0, 2.0], 1)]
    with pytest.raises(ParquetOutputError, match="output line 2: an embedding of 2 values, where earlier ones have 3"):
        _convert(rows, task="embed")


def test_a_record_of_several_texts_is_refused_saying_what_to_do_instead() -> None:
    several = {"custom_id": "b", "response": {"embeddings": [[1.0, 2.0], [3.0, 4.0]], "usage": {"prompt_tokens": 6}}}
    with pytest.raises(ParquetOutputError, match=r"output line 2: a record of several texts .* ask for JSONL output"):
        _convert([_embedding("a", [1.0, 2.0], 1), several], task="embed")


def test_a_line_without_response_or_error_is_refused() -> None:
    with pytest.raises(ParquetOutputError, match="output line 1: neither a 'response' nor an 'error'"):
        _convert([{"custom_id": "a"}], task="generate")
