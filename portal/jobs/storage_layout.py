"""Where a job's objects live: under its root, fixed at submission (`job_prefix` of the storage
configured then), so a job keeps its place even if the configured storage changes later."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings

from tasks.shared.storage import join_uri

if TYPE_CHECKING:
    from portal.jobs.models import Job

OUTPUT_NAME = "output.jsonl"


def job_prefix(job_id: str) -> str:
    """The root of a new job's objects in the storage configured now."""
    return join_uri(settings.BATCHERY_STORAGE_URL, "jobs", str(job_id))


def job_root(job: Job) -> str:
    """The root of an existing job's objects: the folder of its output."""
    return job.output_uri.rsplit("/", 1)[0]


def shard_input_uri(root: str, index: int) -> str:
    return join_uri(root, "input", f"shard-{index:05d}.jsonl")


def grouped_shard_input_uri(root: str, plan_id: str, index: int) -> str:
    """A prefix-grouped job's shard input, under a folder of the one planner run that wrote it: a planner
    that replaces a dead one writes beside it, never over a file a shard row may already name."""
    return join_uri(root, "input", f"grouped-{plan_id}", f"shard-{index:05d}.jsonl")


def shard_positions_uri(input_uri: str) -> str:
    """Beside a prefix-grouped shard's input: its records' 0-based positions in the job's input, in the
    shard's order (ascending), as little-endian unsigned 64-bit integers."""
    return input_uri.removesuffix(".jsonl") + ".positions"


def shard_prefix(root: str, index: int) -> str:
    return join_uri(root, "shards", f"{index:05d}")


def pause_marker_uri(root: str) -> str:
    """Exists while the job is paused: workers read it beside the Redis flag, since storage outlives Redis."""
    return join_uri(root, "paused")


def output_uri(job_id: str) -> str:
    return join_uri(job_prefix(job_id), OUTPUT_NAME)


def errors_uri(job_id: str) -> str:
    return join_uri(job_prefix(job_id), "errors.jsonl")


def parquet_output_uri(root: str) -> str:
    """The Parquet copy of the output, for jobs that ask for Parquet (the JSONL stays: retries stitch it)."""
    return join_uri(root, "output.parquet")


def comparison_uri(root: str) -> str:
    """A re-run's comparison report against the job it re-runs, beside its output."""
    return join_uri(root, "comparison.json")
