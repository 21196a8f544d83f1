"""Parquet pieces: a shard's output rows written as Parquet by the shard, concatenated by the merge.

A job that asks for Parquet output used to get it from its merged JSONL, every embedding float
printed by the shard and parsed back by the merge. Now each shard attempt also writes its rows as
a Parquet piece straight from the engine's responses (`PieceWriter`: embeddings stacked from their
float32 arrays), and the merge concatenates the committed pieces in shard order (`merge_pieces`).

The merged file holds what `tasks.shared.formats.parquet_output.jsonl_to_parquet` writes from the JSONL:
the same schema, rows and row groups of `rows_per_group` rows (the schema fixed by the first row
group, as there); only its pages may be cut elsewhere, as the batches of the pieces fall. Pieces
that disagree on the embedding length (or a file the JSONL path would refuse) raise
`PiecesDisagree`, and the caller merges through the JSONL instead, whose error names the line.
Memory holds one output row group and one batch of a piece, whatever the output's size.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.shared.formats.parquet_output import output_schema, parquet_writer, rows_for

ROWS_PER_GROUP = 10_000
"""Rows of a row group, in a piece and in the merged file (as `jsonl_to_parquet` writes them)."""
SPILL_IN_MEMORY_BYTES = 64 * 1024 * 1024
"""A piece read from a stream that cannot seek (S3) is copied aside first: in memory up to this."""


class PiecesDisagree(ValueError):
    """The pieces cannot give the file the JSONL would: embeddings of different lengths, a piece unreadable."""


class PieceWriter:
    """Writes one shard attempt's rows to `target` as Parquet, a row group at a time.

    Rows go in as the output line's record: ``{"custom_id", "response" | "error"}`` with the
    engine's own values (an embedding stays its float32 array). Raises `ParquetOutputError` on a
    row the Parquet output cannot hold (a record of several embeddings, another length).
    """

    def __init__(self, target: BinaryIO, *, task: str, rows_per_group: int = ROWS_PER_GROUP) -> None:
        self._target = target
        self._rows = rows_for(task)
        self._rows_per_group = rows_per_group
        self._writer: pq.ParquetWriter | None = None
        self.written = 0

    def add(self, row: dict[str, Any]) -> None:
        self.written += 1
        self._rows.add(self.written, row)
        if self._rows.count == self._rows_per_group:
            self._flush()

    def close(self) -> None:
        if self._writer is None or self._rows.count:
            self._flush()
        assert self._writer is not None
        self._writer.close()

    def _flush(self) -> None:
        table = self._rows.take()
        if self._writer is None:
            self._writer = parquet_writer(self._target, table.schema)
        self._writer.write_table(table, row_group_size=max(table.num_rows, 1))


@dataclass(frozen=True)
class PieceSource:
    """One shard's rows for the merge: its Parquet piece, or (a shard without one) its JSONL lines."""

    piece: Callable[[], AbstractContextManager[BinaryIO]] | None = None
    """Opens the shard's committed Parquet piece."""
    lines: Callable[[], Iterable[bytes]] | None = None
    """The shard's output lines (error lines of a shard that never committed): few, and without embeddings."""


def merge_pieces(
    sources: Iterable[PieceSource], target: BinaryIO, *, task: str, rows_per_group: int = ROWS_PER_GROUP
) -> int:
    """Concatenate the sources' rows, in order, into `target` as the job's Parquet output; return the rows.

    `target` is left open. Raises `PiecesDisagree` where the JSONL path would write another file or none.
    """
    groups = _Regroup(task, rows_per_group)
    writer: pq.ParquetWriter | None = None
    for source in sources:
        for batch in _batches(source, task):
            for table in groups.add(batch):
                writer = _write(writer, target, table)
    for table in groups.finish():
        writer = _write(writer, target, table)
    assert writer is not None
    writer.close()
    return groups.rows


def _write(writer: pq.ParquetWriter | None, target: BinaryIO, table: pa.Table) -> pq.ParquetWriter:
    if writer is None:
        writer = parquet_writer(target, table.schema)
    writer.write_table(table, row_group_size=max(table.num_rows, 1))
    return writer


def _batches(source: PieceSource, task: str) -> Iterator[pa.RecordBatch]:
    if source.piece is not None:
        with source.piece() as stream, _seekable(stream) as seekable:
            try:
                batches = pq.ParquetFile(seekable).iter_batches(batch_size=ROWS_PER_GROUP)
                yield from batches
            except pa.ArrowException as exc:
                # A piece is an optimisation: a damaged one sends the merge to the JSONL, which is the truth.
                raise PiecesDisagree(f"a piece cannot be read ({exc})") from exc
        return
    assert source.lines is not None
    rows = rows_for(task)
    for line_no, line in enumerate(source.lines(), start=1):
        if line.strip():
            rows.add(line_no, orjson.loads(line))
    yield from rows.take().to_batches()


@contextmanager
def _seekable(stream: BinaryIO) -> Iterator[BinaryIO]:
    """The stream itself when it can seek (a local file), else a copy of it (an S3 body): Parquet
    is read from its footer backwards."""
    if stream.seekable():
        yield stream
        return
    with tempfile.SpooledTemporaryFile(max_size=SPILL_IN_MEMORY_BYTES) as copy:
        shutil.copyfileobj(stream, copy, 1024 * 1024)
        copy.seek(0)
        yield copy  # type: ignore[misc]


class _Regroup:
    """Cuts the pieces' batches into the output's row groups, fixing the schema at the first, as
    `jsonl_to_parquet` does: embeddings are a fixed-size list when a row of the first group has one."""

    def __init__(self, task: str, rows_per_group: int) -> None:
        self._task = task
        self._rows_per_group = rows_per_group
        self._embed = task == "embed"
        self._pending: list[pa.Table] = []
        self._count = 0
        self._dim: int | None = None
        self._schema: pa.Schema | None = None
        self.rows = 0

    def add(self, batch: pa.RecordBatch) -> Iterator[pa.Table]:
        table = pa.Table.from_batches([batch])
        self.rows += table.num_rows
        while table.num_rows:
            room = self._rows_per_group - self._count
            head, table = table.slice(0, room), table.slice(room)
            # Checked slice by slice: the first group's rows alone decide the schema, as in the JSONL path.
            if self._embed:
                self._check_dim(head.column("embedding"))
            self._pending.append(head)
            self._count += head.num_rows
            if self._count == self._rows_per_group:
                yield self._take()

    def finish(self) -> Iterator[pa.Table]:
        if self._schema is None or self._count:
            yield self._take()

    def _take(self) -> pa.Table:
        if self._schema is None:
            self._schema = output_schema(self._task, dim=self._dim)
        schema = self._schema
        tables = [table.select(schema.names).cast(schema) for table in self._pending]
        self._pending, self._count = [], 0
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def _check_dim(self, embeddings: pa.ChunkedArray) -> None:
        """Every embedding has the length of the output's first one, as the JSONL path demands."""
        if embeddings.null_count == len(embeddings):
            return
        if pa.types.is_fixed_size_list(embeddings.type):
            dims = {embeddings.type.list_size}
        else:
            lengths = pc.min_max(pc.list_value_length(embeddings))
            dims = {lengths["min"].as_py(), lengths["max"].as_py()}
        if self._dim is None and len(dims) == 1:
            self._dim = dims.pop()
        elif dims != {self._dim}:
            raise PiecesDisagree(f"embeddings of {sorted(dims)} values, where earlier ones have {self._dim}")
