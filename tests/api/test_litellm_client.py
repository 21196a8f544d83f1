"""LiteLLM's batch functions, pointed at Batchery as an OpenAI-compatible provider, run batches to completion.

A second real client of the Batch API next to the official `openai` one (test_openai_batches.py): LiteLLM
wraps that client but converts every answer into its own types, so a field or status it reads differently
shows up here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import Caller
from tests.support.openai_batches import ENDED

# LiteLLM fetches its price list from GitHub when imported unless told to use the copy it ships.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
litellm = pytest.importorskip("litellm")

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def _provider(live_server: Any, caller: Caller) -> dict[str, Any]:
    """What every LiteLLM call takes to reach this server as the `openai` provider, with the caller's key."""
    return {
        "custom_llm_provider": "openai",
        "api_base": f"{live_server.url}/v1",
        "api_key": caller.key,
        "max_retries": 0,
        "timeout": 60,
    }


def _requests(url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"custom_id": f"req-{n}", "method": "POST", "url": url, "body": body} for n, body in enumerate(bodies)]


def _run_batch(provider: dict[str, Any], path: Path, endpoint: str, workers: dict[str, Any]) -> Any:
    """Upload ``path``, create a batch on it and poll until it ends (bounded); return the ended batch."""
    with path.open("rb") as handle:
        uploaded = litellm.create_file(file=handle, purpose="batch", **provider)
    assert uploaded.id and uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size

    batch = litellm.create_batch(
        completion_window="24h",
        endpoint=endpoint,
        input_file_id=uploaded.id,
        metadata={"client": "litellm"},
        **provider,
    )
    assert batch.status in ("validating", "in_progress") and batch.input_file_id == uploaded.id
    assert batch.metadata == {"client": "litellm"}

    deadline = time.monotonic() + 180
    while batch.status not in ENDED:
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {name}\n{w.log_tail()}" for name, w in workers.items())
            raise AssertionError(f"batch {batch.id} still {batch.status} after 180s\n{logs}")
        time.sleep(0.3)
        batch = litellm.retrieve_batch(batch_id=batch.id, **provider)
    return batch


def _output_lines(provider: dict[str, Any], batch: Any) -> list[dict[str, Any]]:
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None and batch.error_file_id is None
    content = litellm.file_content(file_id=batch.output_file_id, **provider)
    return [json.loads(line) for line in content.text.splitlines()]


def test_litellm_runs_an_embeddings_batch_to_completion(
    live_server: Any,
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    minilm: Any,
    write_jsonl: Callable[..., Path],
) -> None:
    provider = _provider(live_server, caller("acme"))
    texts = [f"LiteLLM sentence {n} about {['rivers', 'GPUs', 'bread'][n % 3]}." for n in range(8)]
    path = write_jsonl(
        _requests("/v1/embeddings", [{"model": minilm.name, "input": text} for text in texts]), "embeddings.jsonl"
    )

    batch = _run_batch(provider, path, "/v1/embeddings", pipeline_workers)

    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (8, 8, 0)
    assert batch.completed_at is not None and batch.in_progress_at is not None
    lines = _output_lines(provider, batch)
    assert [line["custom_id"] for line in lines] == [f"req-{n}" for n in range(8)]
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        [item] = line["response"]["body"]["data"]
        # all-MiniLM-L6-v2 gives 384 dimensions.
        assert len(item["embedding"]) == 384 and all(isinstance(x, float) for x in item["embedding"])


def test_litellm_runs_a_chat_completions_batch_to_completion(
    live_server: Any,
    pipeline_workers: dict[str, Any],
    caller: Callable[..., Caller],
    write_jsonl: Callable[..., Path],
    tiny_chat: Any,
) -> None:
    provider = _provider(live_server, caller("acme"))
    bodies = [
        {"model": "tiny-chat", "messages": [{"role": "user", "content": f"Question {n}?"}], "max_tokens": 5}
        for n in range(6)
    ]
    path = write_jsonl(_requests("/v1/chat/completions", bodies), "chat.jsonl")

    batch = _run_batch(provider, path, "/v1/chat/completions", pipeline_workers)

    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 6, 0)
    lines = _output_lines(provider, batch)
    assert [line["custom_id"] for line in lines] == [f"req-{n}" for n in range(6)]
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny-chat"
        [choice] = body["choices"]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
        assert 1 <= body["usage"]["completion_tokens"] <= 5
