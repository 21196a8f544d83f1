"""A large batch file is validated off the request: the official client's `create` returns at once with the
batch `validating`, the portal keeps answering, and the control worker ends the batch naming the bad lines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.api.conftest import Caller

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(420)]

FILE_BYTES = 150 * 1024 * 1024
# Requests of about a kilobyte, as real ones are: some 140,000 lines to check.
INPUT_CHARS = 1_000


def _large_requests_file(path: Path, model: str, *, bad_line: str, bad_last_line: str) -> int:
    """Embeddings requests until the file passes FILE_BYTES, its third line and an extra last line bad;
    the number of lines."""
    text = ("Rivers run to the sea while the GPUs hum and the bread rises slowly. " * 40)[:INPUT_CHARS]
    size, line_no = 0, 0
    with path.open("w", buffering=1 << 20) as handle:
        while size < FILE_BYTES:
            line_no += 1
            request = {
                "custom_id": f"req-{line_no}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": f"{line_no} {text}"},
            }
            line = bad_line if line_no == 3 else json.dumps(request)
            handle.write(line + "\n")
            size += len(line) + 1
        handle.write(bad_last_line + "\n")
    return line_no + 1


def test_a_150_mb_batch_file_is_validating_at_once_and_ends_failed_naming_its_bad_lines_while_the_portal_answers(
    live_server: Any, pipeline_workers: dict[str, Any], caller: Callable[..., Caller], minilm: Any, tmp_path: Path
) -> None:
    alice = caller("acme")
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=alice.key, max_retries=0, timeout=120)
    path = tmp_path / "large.jsonl"
    last = _large_requests_file(
        path,
        minilm.name,
        bad_line="{this line is not JSON",
        bad_last_line=json.dumps({"custom_id": "req-last", "method": "POST", "body": {}}),
    )
    assert path.stat().st_size >= FILE_BYTES
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")

    started = time.monotonic()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    took = time.monotonic() - started

    assert batch.status == "validating", batch
    assert took < 2.0, f"create took {took:.2f}s"
    # The portal answers other requests while the control worker validates.
    answered = time.monotonic()
    assert uploaded.id in [file.id for file in client.files.list(purpose="batch")]
    assert time.monotonic() - answered < 5.0
    deadline = time.monotonic() + 300
    while batch.status == "validating" and time.monotonic() < deadline:
        asked = time.monotonic()
        batch = client.batches.retrieve(batch.id)
        assert time.monotonic() - asked < 5.0, "the portal stalled while a batch validated"
        time.sleep(0.5)

    logs = "\n".join(f"--- {name}\n{worker.log_tail()}" for name, worker in pipeline_workers.items())
    assert batch.status == "failed", f"{batch}\n{logs}"
    assert batch.failed_at is not None and batch.in_progress_at is None and batch.output_file_id is None
    assert batch.errors is not None and batch.errors.data is not None
    assert [(error.line, error.code) for error in batch.errors.data] == [(3, "invalid_json"), (last, "invalid_url")]
