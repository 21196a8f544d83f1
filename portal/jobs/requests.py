"""What a caller asks of a submission, as one value: built once by the API's serializer, the web form,
the command line and a re-run, and taken by `job_submit` and `job_dry_run`. Nothing here is checked
yet: `submit.submission_request` checks it, and raises `SubmissionError` naming the field that is wrong."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.shared.formats.records import LineProblem


@dataclass(frozen=True)
class JobRequest:
    model_name: str
    """The catalog model's name."""
    input_uri: str
    """Where the input is: a `file://` or `s3://` URI, or a local path (the operators' command line)."""
    model_version: str | None = None
    """A version of the model; the newest enabled one where unset."""
    params: Mapping[str, Any] | None = field(default=None, hash=False)
    """The model's parameters for this job, over its defaults."""
    shard_size: int | None = None
    """Records a shard; unset, the planner cuts shards by estimated cost."""
    deadline_seconds: float | None = None
    """Seconds from now after which the job expires, keeping what finished."""
    input_format: str = "auto"
    """`auto` (by the name), `jsonl`, `csv`, `tsv` or `parquet`."""
    text_column: str = ""
    """The column holding the text, for tabular inputs."""
    id_column: str = ""
    """The column holding each record's `custom_id`, for tabular inputs."""
    output_format: str = "jsonl"
    """`jsonl` or `parquet`."""
    priority: int | None = None
    """0-9, at most the tenant's own; the tenant's where unset."""
    model_digest: str = ""
    """The digest of the weights the job must run on (``sha256:...``, a manifest's ``weights_digest``); empty: any."""


class SubmissionError(Exception):
    """The request cannot be accepted; `field` names the part of it that is wrong."""

    def __init__(self, message: str, *, field: str, problems: Sequence[LineProblem] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.problems = list(problems)


class InputTooLarge(SubmissionError):
    """A compressed input expands past an operator's limit: `limit` is its value, `setting` its name."""

    def __init__(self, message: str, *, limit: float, setting: str) -> None:
        super().__init__(message, field="input")
        self.limit = limit
        self.setting = setting
