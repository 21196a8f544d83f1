"""Prompt tokens served from a shared prefix's cache, from the shards' manifests to the job's ledger line, the
OpenAI batch's usage and the usage API."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from django.utils import timezone

from portal.jobs.models import Job, JobStatus, JobUsage, Shard, ShardStatus
from portal.jobs.transitions import job_transition
from portal.openai_api.models import Batch, File
from tests.api.conftest import Caller

SHARDS = [(1_000, 900), (600, 0), (2_000, 1_984)]
"""Each shard's (prompt tokens, of them cached)."""


def _ended_batch(caller: Caller, model: Any) -> Batch:
    job = Job.objects.create(
        tenant=caller.tenant, model=model, status=JobStatus.MERGING, input_uri="file:///x.jsonl", shard_size=10
    )
    for index, (prompt, cached) in enumerate(SHARDS):
        Shard.objects.create(
            job=job,
            index=index,
            first_record=index * 10,
            record_count=10,
            input_uri="file:///x",
            prefix_uri="file:///y",
            status=ShardStatus.SUCCEEDED,
            compute_seconds=1.0,
            prompt_tokens=prompt,
            completion_tokens=10,
            cached_prompt_tokens=cached,
        )
    job_transition(
        job_id=str(job.pk),
        source=JobStatus.MERGING,
        target=JobStatus.SUCCEEDED,
        succeeded_records=30,
        finished_at=timezone.now(),
    )
    file = File.objects.create(
        id=f"file-{uuid.uuid4().hex[:24]}", tenant=caller.tenant, purpose="batch", filename="in.jsonl", bytes=1, uri="x"
    )
    return Batch.objects.create(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        tenant=caller.tenant,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        input_file_id=file.id,
        job=job,
        finalized_at=timezone.now(),
    )


def test_the_ledger_the_openai_batch_and_the_usage_api_show_the_cached_prompt_tokens(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    batch = _ended_batch(alice, minilm)
    cached = sum(shard[1] for shard in SHARDS)

    ledger = JobUsage.objects.get(job=batch.job)
    assert (ledger.prompt_tokens, ledger.cached_prompt_tokens) == (3_600, cached)
    usage = alice.client.get(f"/v1/batches/{batch.pk}").json()["usage"]
    assert (usage["input_tokens"], usage["input_tokens_details"]) == (3_600, {"cached_tokens": cached})
    [line] = alice.client.get("/api/v1/usage/").json()["results"]
    assert (line["prompt_tokens"], line["cached_prompt_tokens"]) == (3_600, cached)
    [month] = alice.client.get("/api/v1/usage/periods/").json()
    assert (month["prompt_tokens"], month["cached_prompt_tokens"]) == (3_600, cached)


def test_a_running_batch_sums_the_cached_prompt_tokens_of_its_settled_shards(
    caller: Callable[..., Caller], minilm: Any
) -> None:
    alice = caller("acme")
    batch = _ended_batch(alice, minilm)
    Job.objects.filter(pk=batch.job_id).update(status=JobStatus.RUNNING, finished_at=None)

    usage = alice.client.get(f"/v1/batches/{batch.pk}").json()["usage"]

    assert usage["input_tokens_details"] == {"cached_tokens": sum(shard[1] for shard in SHARDS)}
