"""What the merge makes of one shard: its outcome (the committed attempt, or why it has none) and the
error lines that stand for the records of a shard without a committed attempt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from portal.jobs.input_display import tenant_text
from portal.jobs.models import Shard
from tasks.shared.specs import ShardManifest
from tasks.shared.storage import store_for


@dataclass(frozen=True)
class ShardOutcome:
    shard: Shard
    manifest: ShardManifest | None
    """The committed attempt, or None when the shard failed for good or was stopped."""
    failure: str = ""
    code: str = "shard_failed"
    """Error code given to the records of a shard without a committed attempt."""


def unfinished_lines(outcome: ShardOutcome) -> list[tuple[str, bytes]]:
    # The lines go to the tenant's output and error files: the failure as its tenant is shown it (a shard's
    # error may name the model's source or a stored file). The shard is read through its job's manager,
    # which hands it the job already read.
    error = {"code": outcome.code, "message": tenant_text(outcome.failure, job=outcome.shard.job)}
    with store_for(outcome.shard.input_uri).open_read(outcome.shard.input_uri) as source:
        ids = [orjson.loads(raw)["custom_id"] for raw in source]
    return [
        (custom_id, orjson.dumps({"custom_id": custom_id, "error": error}, option=orjson.OPT_APPEND_NEWLINE))
        for custom_id in ids
    ]


def unfinished_shard_lines(outcome: ShardOutcome) -> Iterator[bytes]:
    """What the output and the error file hold for a shard without a committed attempt: an error line
    per record (the partial download, `portal.jobs.services.partial`, reads them here too)."""
    return (line for _, line in unfinished_lines(outcome))
