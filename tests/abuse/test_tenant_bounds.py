"""Attacks that ask too much of the shared GPUs and storage: completions and tokens past the limits,
a job cut into a flood of shards, uploads past the tenant's room."""

from __future__ import annotations

import io
import time
from collections.abc import Callable

import orjson
import pytest

from portal.catalog.models import Model
from tests.abuse.conftest import scale
from tests.factories import ModelFactory
from tests.support.abuse import MODEL, AbuseResult, AbuseStack

pytestmark = [pytest.mark.slow, pytest.mark.abuse]


def test_uploads_past_the_tenants_stored_bytes_are_refused(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    room = 4 * 1024 * 1024
    attacker = abuse_stack.tenant("storage-attacker", max_stored_bytes=room)
    upload = b"".join(
        orjson.dumps({"custom_id": f"s{n}", "method": "POST", "url": "/v1/embeddings",
                      "body": {"model": MODEL, "input": "x" * 1000}}) + b"\n"
        for n in range(1000)
    )  # fmt: skip
    attempts = scale(12, 40)

    def attack() -> str:
        statuses = []
        with abuse_stack.api(attacker) as client:
            for n in range(attempts):
                answer = client.post(
                    "/v1/files", data={"purpose": "batch"}, files={"file": (f"f{n}.jsonl", io.BytesIO(upload))}
                )
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    assert answer.json()["error"]["param"] == "max_stored_bytes", answer.text
        kept = room // len(upload)
        assert statuses == [200] * kept + [429] * (attempts - kept), statuses
        return f"{kept} uploads of {len(upload):,} bytes kept, then 429 max_stored_bytes"

    result = abuse_report("uploads past the tenant's stored bytes", attack)
    assert result.bytes_written <= room + 1024 * 1024


def test_requests_past_n_and_max_tokens_and_a_flood_of_shards_are_refused(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    attacker = abuse_stack.tenant("gpu-attacker")
    with abuse_stack.db():
        ModelFactory(
            name="abuse-chat", engine=Model.Engine.VLLM, task=Model.Task.CHAT, source="/nowhere", is_default=False
        )
    chat = orjson.dumps({"custom_id": "c", "messages": [{"role": "user", "content": "hi"}]}) + b"\n"
    records = scale(300, 3000)
    flood = b"".join(orjson.dumps({"custom_id": f"r{n}", "input": f"s {n}"}) + b"\n" for n in range(records))

    def attack() -> str:
        with abuse_stack.api(attacker) as client:
            for params, setting in (
                ({"max_tokens": 10**9}, "BATCHERY_MAX_OUTPUT_TOKENS"),
                ({"n": 10**4}, "BATCHERY_MAX_N"),
            ):
                refused = client.post(
                    "/api/v1/jobs/",
                    data={"model": "abuse-chat", "params": orjson.dumps(params).decode()},
                    files={"file": ("c.jsonl", io.BytesIO(chat))},
                )
                assert refused.status_code == 400 and setting in refused.json()["error"]["message"], refused.text
            shards = client.post(
                "/api/v1/jobs/",
                data={"model": MODEL, "shard_size": "1"},
                files={"file": ("f.jsonl", io.BytesIO(flood))},
            )
            assert shards.status_code == 201, shards.text
            job_id = shards.json()["id"]
            deadline = time.monotonic() + 60
            while (job := client.get(f"/api/v1/jobs/{job_id}/").json())["status"] not in ("failed", "succeeded"):
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
        assert job["status"] == "failed" and "BATCHERY_MAX_SHARDS_PER_JOB" in job["error"], job
        return f"max_tokens 10^9, n 10^4: 400; {records} records at shard_size 1: job failed at planning (shard limit)"

    abuse_report("past n / max_tokens, and a flood of shards", attack)
