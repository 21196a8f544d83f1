"""A job's merged JSONL output as a Parquet file, written one row group at a time (bounded memory).

One row a line, in the output's order. Columns: `custom_id`, `error_code` and `error_message` (null
on success), then by task:

- embed: `embedding` fixed_size_list<float32>[dim], `prompt_tokens` int64;
- generate, chat: `text`, `finish_reason`, `prompt_tokens`, `completion_tokens` (int64);
- any other task: `response`, the response as JSON text.

The schema is fixed when the first row group is written. `dim` is the length of the first
successful row's embedding; when none of the first `rows_per_group` rows succeeded (typically a job
whose every record failed) it is not known then, and `embedding` is a variable list<float32>
instead. Error rows have a null embedding; embeddings of another length than the first are refused,
and so is a record of several texts (``embeddings``), which has no row of its own to fill.

The same row builders (`rows_for`) and writer (`parquet_writer`) make the shards' Parquet pieces,
which the merge concatenates instead where every shard has one (`tasks.shared.formats.parquet_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq


class ParquetOutputError(ValueError):
    """The output cannot be written as Parquet: a malformed line, or embeddings of different lengths."""


def jsonl_to_parquet(lines: Iterable[bytes], target: BinaryIO, *, task: str, rows_per_group: int = 10_000) -> int:
    """Write the output `lines` to `target` as Parquet; return the number of rows written.

    `target` is left open. Blank lines are skipped.
    """
    if rows_per_group < 1:
        raise ValueError(f"rows_per_group must be at least 1, not {rows_per_group}")
    rows = rows_for(task)
    writer: pq.ParquetWriter | None = None
    written = 0
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        rows.add(line_no, _parse(line_no, raw))
        written += 1
        if rows.count == rows_per_group:
            writer = _write(writer, target, rows.take())
    table = rows.take()
    if writer is None or table.num_rows:
        writer = _write(writer, target, table)
    writer.close()
    return written


def parquet_writer(target: BinaryIO, schema: pa.Schema) -> pq.ParquetWriter:
    """The writer of every output Parquet file (and shard piece), so that all encode alike."""
    # Embeddings are dictionary-encoded only to be given up on: random floats rarely repeat, so trying
    # costs several times the write and leaves the file bigger.
    plain = [name for name in schema.names if name != "embedding"]
    return pq.ParquetWriter(target, schema, use_dictionary=plain)


def _write(writer: pq.ParquetWriter | None, target: BinaryIO, table: pa.Table) -> pq.ParquetWriter:
    """Write `table` as one row group; the first table's schema is the file's."""
    if writer is None:
        writer = parquet_writer(target, table.schema)
    writer.write_table(table, row_group_size=max(table.num_rows, 1))
    return writer


def _parse(line_no: int, raw: bytes) -> dict[str, Any]:
    try:
        row = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ParquetOutputError(f"output line {line_no}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("custom_id"), str):
        raise ParquetOutputError(f"output line {line_no}: not an object with a string custom_id")
    if not isinstance(row.get("error"), dict) and not isinstance(row.get("response"), dict):
        raise ParquetOutputError(f"output line {line_no}: neither a 'response' nor an 'error' object")
    return row


def output_schema(task: str, *, dim: int | None) -> pa.Schema:
    """The output file's schema for `task`: with `dim`, embeddings are a fixed-size list of that length."""
    rows = rows_for(task)
    if isinstance(rows, _EmbedRows):
        rows.dim = dim
    return rows.take().schema


def rows_for(task: str) -> _Rows:
    """A row group's builder for `task`: rows go in with `add`, a table comes out of `take`."""
    if task == "embed":
        return _EmbedRows()
    if task in ("generate", "chat"):
        return _GenerateRows()
    return _JsonRows()


class _Rows:
    """One row group's rows, column by column; `take` makes them a table and starts the next."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self.count = 0
        self._ids: list[str] = []
        self._codes: list[str | None] = []
        self._messages: list[str | None] = []

    def add(self, line_no: int, row: dict[str, Any]) -> None:
        self._ids.append(row["custom_id"])
        error = row.get("error")
        if isinstance(error, dict):
            self._codes.append(_text(error.get("code")))
            self._messages.append(_text(error.get("message")))
            self._add_response(line_no, None)
        else:
            self._codes.append(None)
            self._messages.append(None)
            self._add_response(line_no, row["response"])
        self.count += 1

    def take(self) -> pa.Table:
        columns = {
            "custom_id": pa.array(self._ids, pa.string()),
            "error_code": pa.array(self._codes, pa.string()),
            "error_message": pa.array(self._messages, pa.string()),
            **self._take_responses(),
        }
        self._start()
        return pa.table(columns)

    def _add_response(self, line_no: int, response: dict[str, Any] | None) -> None:
        raise NotImplementedError

    def _take_responses(self) -> dict[str, pa.Array]:
        raise NotImplementedError


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _usage(response: dict[str, Any], key: str) -> Any:
    usage = response.get("usage")
    return usage.get(key) if isinstance(usage, dict) else None


class _EmbedRows(_Rows):
    def __init__(self) -> None:
        self.dim: int | None = None
        """The first successful row's embedding length, for the whole file."""
        self.fixed: bool | None = None
        """Whether `embedding` is a fixed-size list; decided by the first row group."""
        super().__init__()

    def _start(self) -> None:
        super()._start()
        self._embeddings: list[np.ndarray[Any, np.dtype[np.float32]] | None] = []
        self._prompt_tokens: list[Any] = []

    def _add_response(self, line_no: int, response: dict[str, Any] | None) -> None:
        if response is None:
            self._embeddings.append(None)
            self._prompt_tokens.append(None)
            return
        if "embeddings" in response:
            raise ParquetOutputError(
                f"output line {line_no}: a record of several texts has several embeddings, and the Parquet output "
                "holds one a row; ask for JSONL output, or give each text its own record"
            )
        try:
            vector = np.asarray(response.get("embedding"), dtype=np.float32)
        except (TypeError, ValueError):
            vector = np.empty(0, dtype=np.float32)
        if vector.ndim != 1 or vector.size == 0:
            raise ParquetOutputError(f"output line {line_no}: the response has no embedding (a list of numbers)")
        if self.dim is None:
            self.dim = vector.size
        elif vector.size != self.dim:
            raise ParquetOutputError(
                f"output line {line_no}: an embedding of {vector.size} values, where earlier ones have {self.dim}"
            )
        self._embeddings.append(vector)
        self._prompt_tokens.append(_usage(response, "prompt_tokens"))

    def _take_responses(self) -> dict[str, pa.Array]:
        if self.fixed is None:
            self.fixed = self.dim is not None
        lengths = [0 if vector is None else vector.size for vector in self._embeddings]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        present = [vector for vector in self._embeddings if vector is not None]
        values = np.concatenate(present) if present else np.empty(0, dtype=np.float32)
        # JSON has no infinity: the JSONL holds null there, read back as NaN. Only an engine's own
        # arrays (a shard's Parquet piece) can carry one; it gets the JSONL's NaN.
        values[np.isinf(values)] = np.nan
        mask = np.array([vector is None for vector in self._embeddings], dtype=bool)
        embeddings = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values), mask=pa.array(mask))
        target = pa.list_(pa.float32(), self.dim) if self.fixed else pa.list_(pa.float32())
        return {"embedding": embeddings.cast(target), "prompt_tokens": pa.array(self._prompt_tokens, pa.int64())}


class _GenerateRows(_Rows):
    def _start(self) -> None:
        super()._start()
        self._texts: list[Any] = []
        self._finish_reasons: list[Any] = []
        self._prompt_tokens: list[Any] = []
        self._completion_tokens: list[Any] = []

    def _add_response(self, line_no: int, response: dict[str, Any] | None) -> None:
        response = response or {}
        self._texts.append(response.get("text"))
        self._finish_reasons.append(response.get("finish_reason"))
        self._prompt_tokens.append(_usage(response, "prompt_tokens"))
        self._completion_tokens.append(_usage(response, "completion_tokens"))

    def _take_responses(self) -> dict[str, pa.Array]:
        return {
            "text": pa.array(self._texts, pa.string()),
            "finish_reason": pa.array(self._finish_reasons, pa.string()),
            "prompt_tokens": pa.array(self._prompt_tokens, pa.int64()),
            "completion_tokens": pa.array(self._completion_tokens, pa.int64()),
        }


class _JsonRows(_Rows):
    def _start(self) -> None:
        super()._start()
        self._responses: list[str | None] = []

    def _add_response(self, line_no: int, response: dict[str, Any] | None) -> None:
        self._responses.append(None if response is None else orjson.dumps(response).decode())

    def _take_responses(self) -> dict[str, pa.Array]:
        return {"response": pa.array(self._responses, pa.string())}
