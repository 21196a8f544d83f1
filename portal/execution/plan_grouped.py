"""Planning a prefix-grouped job (`prefix_groups.py` chooses the groups): its records are written into
shards of their group, each shard's records in input order, with their positions in the input beside
(`shard_positions_uri`), and every shard row is created in one transaction once every input is written.

Why one transaction at the end: a planner may die at any point, and a grouped job's shards do not hold
consecutive records, so a replacement cannot resume after the shards created as the streaming planner
does. A planner that dies before the transaction leaves no row and its replacement plans from
scratch; one that dies after it left a whole plan, which its replacement only checks again. Each
planner run writes under a folder of its own (`grouped_shard_input_uri`), so no file a row names is
ever written again. The price: a grouped job's first shard starts once its input has been read.
"""

from __future__ import annotations

import sys
import uuid
from array import array
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field, replace
from typing import BinaryIO

import orjson
from django.db import transaction

from portal.execution.prefix_groups import PrefixGrouping, frequent_keys
from portal.execution.shard_cut import CutShard, PlannedShard, ShardCut, ShardCutter, record_chars
from portal.jobs.models import Job, JobStatus, Shard
from portal.jobs.storage_layout import grouped_shard_input_uri, job_root, shard_positions_uri
from tasks.shared.formats.records import Record
from tasks.shared.storage import store_for

ROWS_PER_INSERT = 500


class _Aborted(Exception):
    """Thrown into the open shard writers so that they discard what they hold."""


class GroupedCutter:
    """Where a grouped job's shards start and end, writing nothing: the records of each group, and the
    ungrouped ones, are cut into shards of their own, each stream by its own `ShardCutter` (by cost or
    `shard_size`, without the slow start or the guided shrinking, which follow one stream of
    consecutive shards); shards are numbered in the order they open. `GroupedShardWriter` and the dry
    run (`portal.jobs.services.dry_run`) cut the same shards through it."""

    def __init__(self, cut: ShardCut, *, input_field: str) -> None:
        self._cut = replace(cut, first_seconds=None, guided_spread=0)
        self._input_field = input_field
        self._cutters: dict[int | None, ShardCutter] = {}
        self._open: dict[int | None, int] = {}
        """Each stream's open shard: its index."""
        self._next_index = 0
        self.ended: list[tuple[int, CutShard]] = []
        """(index, shard) of the shards ended so far, in the order they ended."""

    def add(self, group: int | None, chars: int) -> int | None:
        """Count in the job's next record, of `group` (None: ungrouped), its input `chars` characters long
        (`record_chars`); the index of the shard it opens, or None where it joins its stream's open one.
        A stream's shard that ends is in `ended` when its next shard opens."""
        cutter = self._cutters.get(group)
        if cutter is None:
            cutter = self._cutters[group] = ShardCutter(self._cut, input_field=self._input_field)
        if not cutter.add_chars(chars):
            return None
        self._end(group, cutter)
        index = self._open[group] = self._next_index
        self._next_index += 1
        return index

    def _end(self, group: int | None, cutter: ShardCutter) -> None:
        if group in self._open:
            self.ended.append((self._open.pop(group), cutter.ended[-1]))

    def close(self) -> list[CutShard]:
        """End every open shard; every shard, by index."""
        for group, cutter in self._cutters.items():
            cutter.close()
            self._end(group, cutter)
        return [shard for _, shard in sorted(self.ended, key=lambda ended: ended[0])]


def grouped_cut(
    cut: ShardCut, *, input_field: str, keys: Sequence[int], sizes: Sequence[int]
) -> tuple[list[CutShard], int, int] | None:
    """The shards of a job whose records, in input order, have these prefix keys and input sizes
    (`record_chars`), cut as a grouped job's: with its number of groups and the records in them; None
    where it would be planned ungrouped (`frequent_keys`)."""
    groups = frequent_keys(keys)
    if not groups:
        return None
    cutter = GroupedCutter(cut, input_field=input_field)
    in_groups = 0
    for key, size in zip(keys, sizes, strict=True):
        group = groups.get(key)
        in_groups += group is not None
        cutter.add(group, size)
    return cutter.close(), len(groups), in_groups


@dataclass
class _Stream:
    """The open shard of one group (or of the ungrouped records)."""

    index: int = -1
    input_uri: str = ""
    stack: ExitStack = field(default_factory=ExitStack)
    handle: BinaryIO | None = None
    positions: array[int] = field(default_factory=lambda: array("Q"))


class GroupedShardWriter:
    """Writes the records of a grouped job, given in input order, into the shards `GroupedCutter` cuts:
    those of a group into shards of their own, the others into shards of the ungrouped records.
    `on_shard` is called with each shard once its input and positions are written whole.

    Memory is bounded by the groups, not the input: at most one open shard a group and one for the
    ungrouped records (BATCHERY_PREFIX_MAX_GROUPS + 1), each with its store writer's buffer (on S3 up
    to a part, BATCHERY_S3_PART_BYTES: 25 x 16 MiB by default) and the positions of its records
    (8 bytes a record, up to a shard's records), plus a few numbers a shard written."""

    def __init__(
        self,
        root: str,
        cut: ShardCut,
        *,
        input_field: str,
        grouping: PrefixGrouping,
        on_shard: Callable[[PlannedShard], None] | None = None,
    ) -> None:
        self._root = root
        self._plan_id = uuid.uuid4().hex[:12]
        self._cutter = GroupedCutter(cut, input_field=input_field)
        self._input_field = input_field
        self._grouping = grouping
        self._on_shard = on_shard
        self._streams: dict[int | None, _Stream] = {}
        self._position = 0
        self.shards: list[PlannedShard] = []

    def add(self, record: Record) -> None:
        """Write the job's next record (its position is the count of records added before it)."""
        group = self._grouping.group_of(record)
        stream = self._streams.get(group)
        if stream is None:
            stream = self._streams[group] = _Stream()
        opened = self._cutter.add(group, record_chars(record, self._input_field))
        if opened is not None:
            if stream.handle is not None:
                self._finish(stream, self._cutter.ended[-1][1])
            self._open(stream, opened)
        assert stream.handle is not None
        stream.handle.write(orjson.dumps(record.data, option=orjson.OPT_APPEND_NEWLINE))
        stream.positions.append(self._position)
        self._position += 1

    def _open(self, stream: _Stream, index: int) -> None:
        stream.index = index
        stream.input_uri = grouped_shard_input_uri(self._root, self._plan_id, index)
        stream.handle = stream.stack.enter_context(store_for(stream.input_uri).open_write(stream.input_uri))
        stream.positions = array("Q")

    def _finish(self, stream: _Stream, cut: CutShard) -> None:
        """Close the stream's open shard, which `cut` ended, and write its positions."""
        stream.stack.close()
        stream.stack = ExitStack()
        stream.handle = None
        assert cut.record_count == len(stream.positions)
        positions = stream.positions
        if sys.byteorder != "little":
            positions = array("Q", positions)
            positions.byteswap()
        uri = shard_positions_uri(stream.input_uri)
        with store_for(uri).open_write(uri) as out:
            out.write(positions.tobytes())
        planned = PlannedShard(
            index=stream.index,
            first_record=stream.positions[0],
            record_count=cut.record_count,
            input_uri=stream.input_uri,
            input_chars=cut.input_chars,
            estimated_seconds=cut.estimated_seconds,
        )
        self.shards.append(planned)
        if self._on_shard is not None:
            self._on_shard(planned)

    def close(self) -> list[PlannedShard]:
        """End every open shard; the shards written, by index."""
        cuts = self._cutter.close()
        for stream in self._streams.values():
            if stream.handle is not None:
                self._finish(stream, cuts[stream.index])
        return sorted(self.shards, key=lambda shard: shard.index)

    def abort(self) -> None:
        """Discard the open shards: their writers exit with an error, so they never appear."""
        aborted = _Aborted("planning stopped")
        for stream in self._streams.values():
            with suppress(_Aborted):
                stream.stack.__exit__(_Aborted, aborted, None)
            stream.handle = None

    @property
    def groups(self) -> int:
        return len(self._grouping.groups)


def grouped_shards_create(*, job: Job, shards: list[PlannedShard], groups: int) -> bool:
    """Create every shard row of a grouped job and record its `prefix_groups`, in one transaction, under
    the job's row lock. False, creating nothing, where the job is no longer planning or already has
    shards (those of a planner that ran beside this one without its lease: its plan stands)."""
    root = job_root(job)
    with transaction.atomic():
        # The row lock serializes two planners of the job (one without its lease): the second sees the
        # first's shards below.
        if not list(Job.objects.select_for_update().filter(pk=job.pk, status=JobStatus.PLANNING).values_list("pk")):
            return False
        if Shard.objects.filter(job_id=job.pk, round=0).exists():
            return False
        Shard.objects.bulk_create(
            (shard.row(job_id=job.pk, root=root) for shard in shards),
            batch_size=ROWS_PER_INSERT,
        )
        Job.objects.filter(pk=job.pk).update(prefix_groups=groups)
    job.prefix_groups = groups
    return True
