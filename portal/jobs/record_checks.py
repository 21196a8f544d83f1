"""The checks of an input record that need its job: the model (or adapter) the record names
(`portal.jobs.adapters.JobAdapters`), the kinds of media its messages carry, which the model's catalog entry
says it takes (`Model.input_modalities`), and how many distinct reply formats the job's records give (each is
compiled on the slot). The record's shape, and media no model may be given, are `tasks.shared.formats.records`'
to judge; these run after it, at submission for a small input and in the planner for every input.
"""

from __future__ import annotations

import hashlib
import json

from django.conf import settings

from gpuworkers.engines.media import MediaPolicy, messages_media_problem
from portal.catalog.models import Model
from portal.jobs.adapters import JobAdapters
from tasks.shared.formats.jsonl import RecordProblem
from tasks.shared.formats.records import Record, input_field_for


def record_checks(model: Model, adapters: JobAdapters) -> RecordProblem:
    """What is wrong with a well-formed record of a job of `model`, whose records' model names `adapters` judges."""
    if model.task not in (Model.Task.CHAT, Model.Task.GENERATE):
        return adapters.record_problem
    formats = ReplyFormats(settings.BATCHERY_MAX_JOB_SCHEMAS)
    if model.task != Model.Task.CHAT:
        return lambda record: formats.problem(record) or adapters.record_problem(record)
    field = input_field_for(model.task)
    policy = MediaPolicy.configured(model.input_modalities)

    def problem(record: Record) -> str | None:
        media = messages_media_problem(record.data.get(field), policy, field=field)
        if media is not None:
            return media.message
        return formats.problem(record) or adapters.record_problem(record)

    return problem


class ReplyFormats:
    """Counts the distinct reply formats (a record's own ``response_format`` or ``tools``) of one job's records,
    by digest, and refuses the record past `limit`: a slot compiles each into a grammar, so their number bounds
    the compile time one job may cost a shared slot."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[bytes] = set()

    def problem(self, record: Record) -> str | None:
        params = record.data.get("params")
        if not isinstance(params, dict) or (params.get("response_format") is None and params.get("tools") is None):
            return None
        shape = {"response_format": params.get("response_format"), "tools": params.get("tools")}
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()).digest()
        if digest in self._seen:
            return None
        if len(self._seen) >= self._limit:
            return (
                f"params give reply format {self._limit + 1} (response_format or tools) of this job's records, over "
                f"the limit of {self._limit} distinct ones (BATCHERY_MAX_JOB_SCHEMAS): each is compiled on the slot"
            )
        self._seen.add(digest)
        return None
