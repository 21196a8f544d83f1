"""Writing shard inputs of consecutive records: `ShardWriter`, used by the streaming planner (`plan.py`)
and a retry round (`retry.py`); a prefix-grouped job's shards are `plan_grouped.py`'s."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import replace
from typing import BinaryIO

import orjson

from portal.execution.shard_cut import PlannedShard, ShardCut, ShardCutter
from portal.jobs.storage_layout import shard_input_uri
from tasks.shared.formats.records import Record
from tasks.shared.storage import store_for


class ShardWriteAborted(Exception):
    """Thrown into an open shard writer so that it discards what it holds."""


class ShardWriter:
    """Writes records into consecutive shard inputs, each ended where `cut` says; `input_field` is
    the record field whose characters count. The first shard is numbered `first_index` and starts at
    record `first_record`; `on_shard` is called with each shard once its input is written whole."""

    def __init__(
        self,
        root: str,
        cut: ShardCut,
        *,
        input_field: str,
        first_index: int = 0,
        first_record: int = 0,
        on_shard: Callable[[PlannedShard], None] | None = None,
        bytes_read: Callable[[], int | None] | None = None,
    ) -> None:
        self._root = root
        self._cutter = ShardCutter(
            cut, input_field=input_field, first_number=first_index, first_record=first_record, bytes_read=bytes_read
        )
        self._first_index = first_index
        self._first_record = first_record
        self._on_shard = on_shard
        self._stack = ExitStack()
        self._handle: BinaryIO | None = None
        self.shards: list[PlannedShard] = []

    def add(self, record: Record) -> None:
        if self._cutter.add(record):
            self._rotate()
        assert self._handle is not None
        self._handle.write(orjson.dumps(record.data, option=orjson.OPT_APPEND_NEWLINE))

    def _rotate(self) -> None:
        self._finish_current()
        index = self._first_index + len(self.shards)
        uri = shard_input_uri(self._root, index)
        self._handle = self._stack.enter_context(store_for(uri).open_write(uri))
        self.shards.append(PlannedShard(index=index, first_record=0, record_count=0, input_uri=uri))

    def _finish_current(self) -> None:
        """Close the shard being written and fill in its counts, once the cutter has ended it."""
        if self._handle is None:
            return
        self._stack.close()
        self._stack = ExitStack()
        self._handle = None
        cut = self._cutter.ended[len(self.shards) - 1]
        self.shards[-1] = replace(
            self.shards[-1],
            first_record=self._first_record + cut.first_record,
            record_count=cut.record_count,
            input_chars=cut.input_chars,
            estimated_seconds=cut.estimated_seconds,
        )
        if self._on_shard is not None:
            self._on_shard(self.shards[-1])

    def close(self) -> list[PlannedShard]:
        self._cutter.close()
        self._finish_current()
        return self.shards

    def abort(self) -> None:
        """Discard the shard being written: its writer exits with an error, so it never appears."""
        aborted = ShardWriteAborted("planning stopped")
        with suppress(ShardWriteAborted):
            self._stack.__exit__(ShardWriteAborted, aborted, None)
        self._handle = None
