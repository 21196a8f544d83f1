"""Celery workers' logs: JSON lines when ``BATCHERY_LOG_FORMAT=json``, and each task's job in its records.

Imported by `tasks.app`, so the control worker and every slot worker get it. In json mode a
receiver of ``setup_logging`` configures the root logger with `gpuworkers.logs`; Celery 5.7 skips
its own handlers (and its stdout redirection) once any receiver is connected, so the receiver is
connected only in json mode and text mode keeps Celery's own format.

Every mode binds the task's job (``job_id``, ``shard``, ``batch_id``) to the log context from
``task_prerun`` to ``task_postrun``, which covers the task's own records and Celery's
"succeeded"/"failed"/"retry" lines. The tenant is not bound: the arguments do not carry it, and a
database query per task only for logging is not worth it; code that holds the job adds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

from celery.apps import worker as celery_worker
from celery.signals import celeryd_init, setup_logging, task_postrun, task_prerun

from gpuworkers.logs import bind_log_context, clear_log_context, configure_logging, json_line, log_format
from tasks.shared.config import FINALIZE_BATCH_TASK, MERGE_TASK, PLAN_TASK, SHARD_TASK, WAVE_TASK

# Control tasks whose first argument names what they work on.
ID_ARGUMENT = {
    PLAN_TASK: "job_id",
    MERGE_TASK: "job_id",
    FINALIZE_BATCH_TASK: "batch_id",
}


def task_log_fields(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, object]:
    """The log context of one run of task `name`: its job (and shard), read from its arguments."""
    if name == SHARD_TASK:
        spec = args[0] if args else kwargs.get("spec")
        if isinstance(spec, Mapping):
            return {"job_id": spec.get("job_id"), "shard": spec.get("shard_index")}
        return {}
    key = ID_ARGUMENT.get(name)
    if key is None:
        return {}
    value = args[0] if args else kwargs.get(key)
    return {key: str(value)} if value is not None else {}


@task_prerun.connect
def _bind_task(sender: Any = None, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, **_: Any) -> None:
    # Cleared first: a process that died mid-task never ran its postrun, and a pool child runs one
    # task at a time, so whatever is bound now belongs to no task.
    clear_log_context()
    bind_log_context(**task_log_fields(getattr(sender, "name", ""), args or (), kwargs or {}))


@task_postrun.connect
def _clear_task(**_: Any) -> None:
    clear_log_context()


# Celery logs "Task ... received" in the worker's main process, before any task code runs and with
# only the printed form of the arguments (`argsrepr`, cut at 1,024 characters). The fields this
# needs come first in those forms, so they survive the cut.
_FIRST_STRING = re.compile(r"^[(\[]'([^']*)'")
_SHARD_FIELDS = {"job_id": re.compile(r"'job_id': '([^']*)'"), "shard": re.compile(r"'shard_index': (\d+)")}


def received_log_fields(name: str, argsrepr: str, kwargsrepr: str) -> dict[str, object]:
    """The log context of task `name` read from the printed form of its arguments."""
    fields: dict[str, object] = {}
    if name in (SHARD_TASK, WAVE_TASK):  # a wave prints its job and its shards' indexes: the job is read
        for field, pattern in _SHARD_FIELDS.items():
            match = pattern.search(argsrepr) or pattern.search(kwargsrepr)
            if match:
                fields[field] = int(match[1]) if field == "shard" else match[1]
        return fields
    key = ID_ARGUMENT.get(name)
    if key is not None:
        match = _FIRST_STRING.match(argsrepr) or re.search(rf"'{key}': '([^']*)'", kwargsrepr)
        if match:
            fields[key] = match[1]
    return fields


class ReceivedTaskFilter(logging.Filter):
    """Put the job of a received task on Celery's "Task ... received" record (which carries the
    task's name and printed arguments in ``record.data``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        if isinstance(data, Mapping):
            fields = received_log_fields(
                str(data.get("name", "")), str(data.get("args", "")), str(data.get("kwargs", ""))
            )
            for field, value in fields.items():
                if not hasattr(record, field):
                    setattr(record, field, value)
        return True


def _configure(loglevel: int | str | None = None, **_: Any) -> None:
    configure_logging(loglevel or logging.INFO)


def _say_as_json(msg: str, f: IO[str] | None = None) -> None:
    """Celery's `safe_say` (shutdown notices, printed from its signal handlers), as a JSON line.

    Written with one `os.write` as Celery does, not through logging, whose locks a signal handler
    must not take."""
    stream = f if f is not None else sys.__stderr__
    if stream is None:
        return
    line = json_line("celery.apps.worker", logging.INFO, msg.strip()) + "\n"
    # Like Celery's: losing a notice must never abort a shutdown.
    with contextlib.suppress(OSError, ValueError):
        os.write(stream.fileno(), line.encode())


def _prepare_worker(instance: Any = None, options: Mapping[str, Any] | None = None, **_: Any) -> None:
    # Celery prints two things outside logging. The startup banner: control workers are started by
    # deploy units and `manage.py up` with flags of their own, so the worker is made quiet here
    # rather than by `--quiet` everywhere. The shutdown notices of its signal handlers: sent through
    # the JSON formatter instead of printed bare.
    if instance is not None:
        instance.quiet = True
    celery_worker.safe_say = _say_as_json  # type: ignore[attr-defined]  # not in celery-types
    # Celery warns about running as root right after this signal, before it sets logging up; a
    # control worker's Django settings have set it up by then, a slot (no Django) has not.
    configure_logging((options or {}).get("loglevel") or logging.INFO)


# A logger's filter sees the records logged on that very logger; this is the one that says "received".
logging.getLogger("celery.worker.strategy").addFilter(ReceivedTaskFilter())
if log_format() == "json":
    setup_logging.connect(_configure, weak=False)
    celeryd_init.connect(_prepare_worker, weak=False)
