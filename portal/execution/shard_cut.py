"""Where shards end: `ShardCut` says where the planner ends a shard (every so many records, or by
estimated cost from the model's learned throughput, with the slow start and the guided shrinking),
and `ShardCutter` follows it over records in input order, writing nothing.

The planner (`plan.py`), a retry round (`retry.py`) and the dry run (`dry_run.py`) cut the same
shards through them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from portal.catalog.throughput import CostModel, throughput_estimate
from portal.execution.capacity import queue_slots
from portal.execution.dispatch import job_queue
from portal.jobs.models import UNSETTLED, Job, Shard
from portal.jobs.selectors import queue_shards
from portal.jobs.storage_layout import shard_prefix
from tasks.shared.formats.records import Record


def spare_slots(queue: str) -> int:
    """The queue's live slots that no shard is sent to or waits for: those a job planned now can spread
    over at once (at least 1). On a busy fleet a job gets places one by one as other shards end, and
    shrinking its shards to spread it over every slot of the class would only multiply its endings:
    at 1,000 slots, every job under an hour of GPU time was cut into one-second shards. Counted up to
    the slots, through the index of unsettled shards."""
    slots = queue_slots(queue)
    busy = queue_shards(queue).filter(status__in=UNSETTLED)[:slots].count()
    return max(1, slots - busy)


@dataclass(frozen=True)
class ShardCut:
    """Where the planner ends a shard."""

    cost: CostModel
    """Predicts a shard's compute seconds; recorded on every shard however it is cut."""
    shard_size: int | None = None
    """Records per shard, as submitted; None: cut by cost."""
    target_seconds: float = 60.0
    """Cutting by cost: a shard ends before its estimated seconds would pass this."""
    max_records: int = 10_000
    """Cutting by cost: a shard ends at this many records, whatever its estimate."""
    first_seconds: float | None = None
    """Cutting by cost: the first shard's target, doubled for each next one up to `target_seconds`,
    so that a job's first results come within a second whatever its size (slow start), while
    its later shards are as large as the target; None: every shard at the target. The doubling holds
    for the shards that can start at once (`slots`): a shard that waits for another to end gains no
    latency from being short, and on a busy fleet of small jobs short shards would double its endings."""
    guided_spread: int = 0
    """Cutting by cost: each shard ends at the job's work left divided by this many shards a slot
    (down to `min_seconds`): guided self-scheduling, in its factoring variant. Shards shrink as the
    job nears its end, so its slots end together: a slot slower by a tenth, or an estimate off by as
    much, leaves the others idle for a fraction of the last, shortest shards, not of an average one.
    The work left comes from the records counted at submission, or for an input too large to count
    there, from the bytes of it not yet read (`ShardCutter`). 0: no shrinking. A job with no slot to
    spread over (`slots` 1: a busy fleet, or a one-slot one) is not shrunk: its shards start one by one
    as places free, so there are no slots to make end together, and the halving tail (20 s, 10 s,
    5 s, ... down to `min_seconds`) would only add endings."""
    total_records: int = 0
    """The job's records (0: not counted at submission), its estimated seconds, its input's bytes, the
    slots it may spread over (`spare_slots`) and the least seconds a shard is cut at, for the guided
    shrinking."""
    whole_seconds: float = 0.0
    input_bytes: int = 0
    slots: int = 1
    min_seconds: float = 0.0

    @classmethod
    def for_job(cls, job: Job) -> ShardCut:
        cost = throughput_estimate(job.model)
        return cls(
            cost=cost,
            shard_size=job.shard_size,
            target_seconds=float(settings.BATCHERY_TARGET_SHARD_SECONDS),
            max_records=settings.BATCHERY_MAX_SHARD_RECORDS,
            first_seconds=settings.BATCHERY_FIRST_SHARD_SECONDS or None,
            guided_spread=settings.BATCHERY_GUIDED_SHARDS_PER_SLOT,
            total_records=job.total_records or 0,
            # The input's bytes stand in for its characters.
            whole_seconds=cost.seconds(job.total_records, job.input_bytes) if job.total_records else 0.0,
            input_bytes=job.input_bytes or 0,
            slots=spare_slots(job_queue(job)),
            min_seconds=settings.BATCHERY_MIN_SHARD_SECONDS,
        )

    def target_of(self, shard_number: int, *, records_before: int = 0, left_seconds: float | None = None) -> float:
        """The estimated seconds at which the job's `shard_number`-th shard (from 0), starting after
        `records_before` records, ends: the target, the slow start's (for the first `slots` shards), and
        near the end of the job (where it has `slots` to spread over) its work left over `guided_spread`
        shards a slot, whichever is least. The work left is `left_seconds` where given, else what the
        records counted at submission leave."""
        target = self.target_seconds
        if self.first_seconds is not None and shard_number < min(self.slots, 64):
            target = min(target, self.first_seconds * 2**shard_number)
        if self.guided_spread and self.slots > 1:
            if left_seconds is None and self.total_records:
                left_seconds = max(self.total_records - records_before, 0) / self.total_records * self.whole_seconds
            if left_seconds is not None:
                target = min(target, max(self.min_seconds, left_seconds / (self.guided_spread * self.slots)))
        return target

    def limit_of(self, shard_number: int, *, records_before: int = 0, left_seconds: float | None = None) -> float:
        """The estimated seconds a shard may not pass (`ends_before`): its target, with a tolerance
        that keeps 20 records of 0.05 s in a 1 s shard although their float sum is 1.0000000000000002.
        The same for all of a shard's records, so the cutter computes it once a shard."""
        return self.target_of(shard_number, records_before=records_before, left_seconds=left_seconds) * (1 + 1e-9)

    def ends_before(self, records: int, seconds: float, next_seconds: float, limit: float) -> bool:
        """Whether a shard holding `records` records estimated at `seconds`, whose limit is `limit`
        (`limit_of`), ends before the next record, estimated at `next_seconds`."""
        if self.shard_size is not None:
            return records >= self.shard_size
        # A record dearer than the target still gets a shard: it is never cut before its first.
        return records >= self.max_records or (records > 0 and seconds + next_seconds > limit)


def input_chars(value: Any) -> int:
    """Characters of a record's input: a text, a list of texts, or chat messages (their contents,
    text parts only). What the throughput fit calls `chars`.

    Walked with a stack, not recursion: a message's content may be nested as deep as the JSON
    parser allowed."""
    chars = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.append(item["content"] if "content" in item else item.get("text"))
    return chars


def record_chars(record: Record, input_field: str) -> int:
    """`input_chars` of the record's input."""
    value = record.data.get(input_field)
    # A text, the common case, without the walk's call and stack.
    return len(value) if isinstance(value, str) else input_chars(value)


@dataclass(frozen=True)
class CutShard:
    """A shard where the cut ends it, before anything is written."""

    first_record: int
    """Records before it, counted from where the cutting started."""
    record_count: int
    input_chars: int
    estimated_seconds: float


@dataclass(frozen=True)
class PlannedShard:
    """A shard whose input the planner has written whole, before its row exists."""

    index: int
    first_record: int
    """Its first record's position (0-based) in the records it was cut from: the job's input, or for a
    retry round the records retried."""
    record_count: int
    input_uri: str
    input_chars: int = 0
    estimated_seconds: float = 0.0

    def row(self, *, job_id: Any, root: str, round_: int = 0) -> Shard:
        """The shard's row (not saved), its attempts under the job's `root`."""
        return Shard(
            job_id=job_id,
            index=self.index,
            round=round_,
            first_record=self.first_record,
            record_count=self.record_count,
            input_chars=self.input_chars,
            estimated_seconds=self.estimated_seconds,
            input_uri=self.input_uri,
            prefix_uri=shard_prefix(root, self.index),
        )


class ShardCutter:
    """Follows `cut` over records in input order and says where each shard starts, writing nothing:
    the planner's `ShardWriter` and the dry run (`dry_run.py`) cut the same shards through it.

    For a job whose records were not counted at submission, `bytes_read` (the input's bytes read so
    far, None where unknown) gives the guided shrinking its work left: the seconds cut so far, scaled
    by the bytes not yet read to those read."""

    def __init__(
        self,
        cut: ShardCut,
        *,
        input_field: str,
        first_number: int = 0,
        first_record: int = 0,
        bytes_read: Callable[[], int | None] | None = None,
    ) -> None:
        self._cut = cut
        self._input_field = input_field
        # A planner resumed past shards it does not cut again has no estimate of what it read before.
        self._bytes_read = bytes_read if first_record == 0 and not cut.total_records and cut.input_bytes else None
        self._seconds_cut = 0.0
        """Estimated seconds of the shards ended so far."""
        self._number = first_number
        """The job's number (from 0) of the shard being cut: a replan goes on where the last stopped."""
        self._before = first_record
        """The job's records before the shard being cut."""
        self._first = 0
        self._count = 0
        self._chars = 0
        self._seconds = 0.0
        self._limit = self._next_limit()
        self.ended: list[CutShard] = []
        """The shards ended so far, in order."""

    def add(self, record: Record) -> bool:
        """Count `record` in; True when it starts a new shard (the one before it has then ended)."""
        return self.add_chars(record_chars(record, self._input_field))

    def add_chars(self, chars: int) -> bool:
        """`add` for a record whose input is `chars` characters (`record_chars`)."""
        seconds = self._cut.cost.seconds(1, chars)
        starts = self._count == 0 or self._cut.ends_before(self._count, self._seconds, seconds, self._limit)
        if starts:
            self._end()
        self._count += 1
        self._chars += chars
        self._seconds += seconds
        return starts

    def _end(self) -> None:
        if self._count == 0:
            return
        self.ended.append(
            CutShard(
                first_record=self._first,
                record_count=self._count,
                input_chars=self._chars,
                estimated_seconds=self._cut.cost.seconds(self._count, self._chars),
            )
        )
        self._seconds_cut += self._seconds
        self._first += self._count
        self._before += self._count
        self._number += 1
        self._count = 0
        self._chars = 0
        self._seconds = 0.0
        self._limit = self._next_limit()

    def _next_limit(self) -> float:
        return self._cut.limit_of(self._number, records_before=self._before, left_seconds=self._left_seconds())

    def _left_seconds(self) -> float | None:
        if self._bytes_read is None or self._seconds_cut <= 0:
            return None
        read = self._bytes_read()
        if not read:
            return None
        return self._seconds_cut * max(self._cut.input_bytes - read, 0) / read

    def close(self) -> list[CutShard]:
        self._end()
        return self.ended
