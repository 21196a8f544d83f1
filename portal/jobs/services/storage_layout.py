"""Where a job's objects live under Batchery's storage."""

from __future__ import annotations

from django.conf import settings

from tasks.storage import join_uri


def job_prefix(job_id: str) -> str:
    return join_uri(settings.BATCHERY_STORAGE_URL, "jobs", str(job_id))


def shard_input_uri(job_id: str, index: int) -> str:
    return join_uri(job_prefix(job_id), "input", f"shard-{index:05d}.jsonl")


def shard_prefix(job_id: str, index: int) -> str:
    return join_uri(job_prefix(job_id), "shards", f"{index:05d}")


def output_uri(job_id: str) -> str:
    return join_uri(job_prefix(job_id), "output.jsonl")


def errors_uri(job_id: str) -> str:
    return join_uri(job_prefix(job_id), "errors.jsonl")
