"""A shard attempt's Parquet piece, written beside its JSONL when the job asks for Parquet output.

The piece only spares the merge a JSON round trip: whatever stops it (rows Parquet cannot hold, a
failed write) is logged and the attempt commits without one, so the merge reads its JSONL instead.
A soft time limit is not swallowed: it ends the attempt, piece and all.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, BinaryIO

import orjson
from celery.exceptions import SoftTimeLimitExceeded

from gpuworkers.batching import RecordResult
from tasks.shared.formats.parquet_pieces import PieceWriter
from tasks.shared.storage import ObjectStore

logger = logging.getLogger(__name__)


class ShardPiece:
    """Used as a context manager around the attempt's output writing; `add` each output line.

    `written` says, after the block, whether the piece at `uri` is whole and may be committed.
    """

    def __init__(self, store: ObjectStore, uri: str, *, task: str) -> None:
        self.store = store
        self.uri = uri
        self.written = False
        # Embeddings are taken from the engine's arrays; other tasks' rows from the JSON line
        # itself, so the piece holds what the JSONL path would read back, value for value.
        self._from_result = task == "embed"
        self._task = task
        self._opened: AbstractContextManager[BinaryIO] | None = None
        self._writer: PieceWriter | None = None

    def __enter__(self) -> ShardPiece:
        self._guard(self._open)
        return self

    def _open(self) -> None:
        self._opened = self.store.open_write(self.uri)
        self._writer = PieceWriter(self._opened.__enter__(), task=self._task)

    def add(self, line: bytes, result: RecordResult | None) -> None:
        if self._writer is None:
            return
        row: dict[str, Any]
        if self._from_result and result is not None:
            outcome = ("error", result.error) if result.error is not None else ("response", result.response)
            row = {"custom_id": result.custom_id, outcome[0]: outcome[1]}
        else:
            row = orjson.loads(line)
        writer = self._writer
        self._guard(lambda: writer.add(row))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._abandon(exc)
            return
        writer = self._writer
        if writer is None:
            return
        self._guard(writer.close)
        opened = self._opened
        if opened is not None and self._writer is not None:
            self._opened = None
            self._guard(lambda: opened.__exit__(None, None, None))
            self.written = self._writer is not None

    def _guard(self, step: Any) -> None:
        try:
            step()
        except SoftTimeLimitExceeded:
            raise
        except Exception as exc:
            logger.info("no Parquet piece at %s (the merge reads the JSONL): %s", self.uri, exc)
            self._abandon(exc)

    def _abandon(self, exc: BaseException) -> None:
        """Drop the piece: the store discards an object whose write block fails."""
        self._writer = None
        opened, self._opened = self._opened, None
        if opened is None:
            return
        try:
            opened.__exit__(type(exc), exc, exc.__traceback__)
        except Exception:
            logger.debug("dropping the Parquet piece at %s", self.uri, exc_info=True)
