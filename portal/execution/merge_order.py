"""Input order for a prefix-grouped job's merge (`plan_grouped.py`): its shards hold the records of one
group each, in input order but not consecutive, so the output and the error file are a k-way merge
of the shards' lines by the positions written beside each shard's input (`shard_positions_uri`).
The bytes are those an ungrouped plan of the same job publishes: each line is the shard's own.

A shard is opened only when the merge reaches its first position (`Shard.first_record`), so the
shards open at once are those whose positions interleave: for the planner's layout one a group and
one of the ungrouped records (BATCHERY_PREFIX_MAX_GROUPS + 1), whatever the job's size, each holding
its positions (8 bytes a record).
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import orjson

from portal.execution.shard_outcomes import ShardOutcome, unfinished_shard_lines
from portal.jobs.models import Shard
from portal.jobs.storage_layout import shard_positions_uri
from tasks.shared.storage import store_for


def shard_positions(shard: Shard) -> array[int]:
    """The input positions of a grouped shard's records, in its order."""
    uri = shard_positions_uri(shard.input_uri)
    positions = array("Q", store_for(uri).read_bytes(uri))
    if sys.byteorder != "little":
        positions.byteswap()
    return positions


def _committed_lines(uri: str) -> Iterator[bytes]:
    with store_for(uri).open_read(uri) as source:
        yield from source


def _positioned(outcome: ShardOutcome, *, errors_only: bool) -> Iterator[tuple[int, bytes]]:
    positions = shard_positions(outcome.shard)
    if outcome.manifest is None:
        lines: Iterable[bytes] = unfinished_shard_lines(outcome)
    else:
        lines = _committed_lines(outcome.manifest.output_uri)
    for position, line in zip(positions, lines, strict=True):
        # The same lines the shard's error file holds: those of its records that failed.
        if not errors_only or outcome.manifest is None or "error" in orjson.loads(line):
            yield position, line


def lines_in_input_order(
    outcomes: list[ShardOutcome], *, errors_only: bool = False, until: int | None = None
) -> Iterator[bytes]:
    """The output lines of a grouped job's shards in input order, or with `errors_only` its error lines;
    with `until`, those of the records before that position only. Every record has a line: the
    positions must run 0, 1, 2, ... (ValueError otherwise)."""
    # Only shards with a failed record hold error lines.
    chosen = [o for o in outcomes if not errors_only or o.manifest is None or o.manifest.failed]
    waiting = sorted(chosen, key=lambda o: o.shard.first_record, reverse=True)
    heap: list[tuple[int, int, bytes, Iterator[tuple[int, bytes]]]] = []

    def take(shard_index: int, lines: Iterator[tuple[int, bytes]]) -> None:
        following = next(lines, None)
        if following is not None:
            heapq.heappush(heap, (following[0], shard_index, following[1], lines))

    expected = 0
    while waiting or heap:
        while waiting and (not heap or waiting[-1].shard.first_record < heap[0][0]):
            outcome = waiting.pop()
            take(outcome.shard.index, _positioned(outcome, errors_only=errors_only))
        if not heap:
            continue
        position, shard_index, line, lines = heapq.heappop(heap)
        if until is not None and position >= until:
            return
        if position < expected or (not errors_only and position != expected):
            raise ValueError(f"shard {shard_index} holds input position {position} where {expected} was due")
        expected = position + 1
        yield line
        take(shard_index, lines)


def write_in_input_order(outcomes: list[ShardOutcome], target: BinaryIO) -> None:
    target.writelines(lines_in_input_order(outcomes))


def write_errors_in_input_order(outcomes: list[ShardOutcome], target: BinaryIO) -> None:
    target.writelines(lines_in_input_order(outcomes, errors_only=True))
