"""The official `openai` client against a live Batchery server: the steps the batch end-to-end tests share."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai

ENDED = {"completed", "failed", "expired", "cancelled"}


def openai_client(live_server: Any, key: str) -> openai.OpenAI:
    """The client as a user builds it, pointed at ``live_server``; no retries, so a bad answer shows."""
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=60)


def requests_file(path: Path, url: str, bodies: list[dict[str, Any]]) -> Path:
    """A batch input file of one request a body, with custom_ids ``req-0``, ``req-1``..."""
    with path.open("w") as handle:
        for n, body in enumerate(bodies):
            handle.write(json.dumps({"custom_id": f"req-{n}", "method": "POST", "url": url, "body": body}) + "\n")
    return path


def wait_for_batch(
    client: openai.OpenAI, batch_id: str, statuses: set[str], workers: dict[str, Any], timeout_s: float = 180
) -> Any:
    """The batch once its status is one of ``statuses``; past ``timeout_s``, fails with the workers' logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.3)
    logs = "\n".join(f"--- {name}\n{w.log_tail()}" for name, w in workers.items())
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s}s\n{logs}")


def run_batch(client: openai.OpenAI, path: Path, endpoint: Any, workers: dict[str, Any], **create: Any) -> Any:
    """Upload ``path``, create a batch on it (with ``create``'s extra arguments) and wait until it ends."""
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **create)
    return wait_for_batch(client, batch.id, ENDED, workers)


def batch_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    """The lines of a batch's output or error file, parsed."""
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
