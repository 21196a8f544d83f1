"""Partial results: the output of a job's committed prefix of shards, readable while later shards run.

A read beside the merge it mirrors: in input order, the first round's shards from index 0 up to the
first one not settled, each as the merge puts it in the output file, so a partial download is a
byte-for-byte prefix of the final output and each later one extends the earlier.

- A committed shard gives its committed attempt's output object, streamed.
- A shard failed for good gives the `shard_failed` error line of each record, as the final merge
  writes them, so the prefix goes on past it. While the job is being cancelled it ends the prefix
  instead: the cancel's merge writes its records as `cancelled` errors.
- A job that has ended gives its final output, or without one (refused at planning, or its merge
  refused) the committed prefix as above. A job whose retry round runs gives the output the earlier
  round published: the retry's merge starts from it and replaces only the lines of records retried.

The output is JSONL whatever the job's output format: a Parquet file is whole only with its footer,
and the JSONL form holds the same records (the final merge writes it before the Parquet copy).
Only a job's cancellation or expiry, which turns unfinished and failed shards into the stop's error
lines, can change lines a partial download showed as `shard_failed`.

A prefix-grouped job's shards hold interleaved records (`portal.execution.merge_order`): its prefix
ends at the first position of its first shard not settled, and the settled shards' lines before it
are merged in input order, as the final merge puts them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from django.db.models import Min

from portal.execution.merge import COPY_BUFFER_BYTES
from portal.execution.merge_order import lines_in_input_order
from portal.execution.settle import read_manifest
from portal.execution.shard_outcomes import ShardOutcome, unfinished_shard_lines
from portal.jobs.models import Job, JobStatus, ShardStatus
from tasks.shared.storage import store_for

OFFERED_STATUSES = frozenset(
    {JobStatus.PLANNING, JobStatus.RUNNING, JobStatus.PAUSED, JobStatus.MERGING, JobStatus.CANCELLING}
)
"""Statuses in which shards may have committed before the output is published: the portal's job page
and the batch object offer the partial download then (it answers in any status)."""


@dataclass(frozen=True)
class InputOrdered:
    """A grouped job's settled shards whose lines come before position `until`, merged in input order."""

    outcomes: tuple[ShardOutcome, ...]
    until: int


@dataclass(frozen=True)
class PartialOutput:
    """What a partial download holds, counted before a byte of it is read."""

    shards: int
    """First-round shards whose records it holds, from index 0."""
    records: int
    """Its lines: one per record of those shards, in input order."""
    complete: bool
    """It is the job's final output: the job has ended and published one."""
    pieces: tuple[str | ShardOutcome | InputOrdered, ...]
    """In order: the URI of an object streamed whole, a shard failed for good (its error lines), or a
    grouped job's settled shards."""

    def chunks(self) -> Iterator[bytes]:
        """The bytes, each object read as a stream and never held whole."""
        for piece in self.pieces:
            if isinstance(piece, ShardOutcome):
                yield from unfinished_shard_lines(piece)
                continue
            if isinstance(piece, InputOrdered):
                yield from lines_in_input_order(list(piece.outcomes), until=piece.until)
                continue
            with store_for(piece).open_read(piece) as source:
                while chunk := source.read(COPY_BUFFER_BYTES):
                    yield chunk


def job_partial_output(job: Job) -> PartialOutput:
    """The job's output as far as its shards have committed (see the module's docstring)."""
    first_round = job.shards.filter(round=0)
    published = job.is_finished or job.retry_round > 0
    if published and store_for(job.output_uri).exists(job.output_uri):
        return PartialOutput(
            shards=job.shard_count,
            records=job.total_records or 0,
            complete=job.is_finished,
            pieces=(job.output_uri,),
        )
    # A cancel's merge rewrites a failed shard's lines with the stop's code: the prefix ends there.
    continuing = (
        [ShardStatus.SUCCEEDED] if job.status == JobStatus.CANCELLING else [ShardStatus.SUCCEEDED, ShardStatus.FAILED]
    )
    if job.prefix_groups:
        return _grouped_partial_output(job, continuing)
    gap = first_round.exclude(status__in=continuing).order_by("index").values_list("index", flat=True).first()
    prefix = first_round if gap is None else first_round.filter(index__lt=gap)
    shards = list(prefix.order_by("index").only("index", "status", "output_uri", "input_uri", "record_count", "error"))
    pieces = tuple(
        shard.output_uri
        if shard.status == ShardStatus.SUCCEEDED
        else ShardOutcome(shard=shard, manifest=None, failure=shard.error)
        for shard in shards
    )
    return PartialOutput(
        shards=len(shards),
        records=sum(shard.record_count for shard in shards),
        complete=False,
        pieces=pieces,
    )


def _grouped_partial_output(job: Job, continuing: list[ShardStatus]) -> PartialOutput:
    """A grouped job's prefix: every record before the first position of a shard not settled belongs to
    a settled shard (that shard's first position comes before it), so those records' lines are whole."""
    first_round = job.shards.filter(round=0)
    until = first_round.exclude(status__in=continuing).aggregate(first=Min("first_record"))["first"]
    shards = first_round.filter(status__in=continuing)
    if until is not None:
        shards = shards.filter(first_record__lt=until)
    outcomes = []
    for shard in shards.order_by("index"):
        manifest = read_manifest(shard) if shard.status == ShardStatus.SUCCEEDED else None
        outcomes.append(ShardOutcome(shard=shard, manifest=manifest, failure=shard.error))
    records = sum(shard.record_count for shard in first_round) if until is None else until
    return PartialOutput(
        shards=len(outcomes),
        records=records,
        complete=False,
        pieces=(InputOrdered(outcomes=tuple(outcomes), until=records),),
    )
