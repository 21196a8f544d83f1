"""The checks of an input record that need its job's model: the model (or adapter) the record names
(`portal.jobs.adapters.JobAdapters`), and the kinds of media its messages carry, which the model's catalog entry
says it takes (`Model.input_modalities`). The record's shape, and media no model may be given, are
`tasks.shared.formats.records`' to judge; these run after it, at submission for a small input and in the planner
for every input.
"""

from __future__ import annotations

from gpuworkers.engines.media import MediaPolicy, messages_media_problem
from portal.catalog.models import Model
from portal.jobs.adapters import JobAdapters
from tasks.shared.formats.jsonl import RecordProblem
from tasks.shared.formats.records import Record, input_field_for


def record_checks(model: Model, adapters: JobAdapters) -> RecordProblem:
    """What is wrong with a well-formed record of a job of `model`, whose records' model names `adapters` judges."""
    if model.task != Model.Task.CHAT:
        return adapters.record_problem
    field = input_field_for(model.task)
    policy = MediaPolicy.configured(model.input_modalities)

    def problem(record: Record) -> str | None:
        media = messages_media_problem(record.data.get(field), policy, field=field)
        return media.message if media is not None else adapters.record_problem(record)

    return problem
