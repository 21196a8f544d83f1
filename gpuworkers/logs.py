"""Log output of every Batchery process: plain text, or one JSON object a line (``BATCHERY_LOG_FORMAT``).

The portal (through ``LOGGING`` in its settings), the control worker, the GPU launcher and its slot
workers all use the formatter and filter defined here, so a central log system sees one shape
everywhere and can follow a job across machines by its ``job_id``. No Django and no Celery here:
``tasks.shared.logging_setup`` ties this to Celery's signals.

``BATCHERY_LOG_FORMAT``
    ``text`` (default): ``%(asctime)s %(levelname)s %(name)s %(message)s``, as before.
    ``json``: ``time``, ``level``, ``logger``, ``message``, the log context (``job_id``, ``shard``,
    ``tenant``...), ``host``, ``slot`` where set, any ``extra`` of the call, and ``exc_info``.
"""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType, TracebackType
from typing import IO, Any

from pythonjsonlogger.json import JsonFormatter as _PythonJsonFormatter

from gpuworkers.settings import LOG_FORMAT, ImproperlyConfiguredEnv, slot_name

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
LOG_FORMATS = ("text", "json")

# Attributes every LogRecord has: a context field of one of these names would overwrite the record's own.
_RECORD_ATTRIBUTES = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

# Per thread and per asyncio task, so two tasks or requests running side by side never mix their fields.
_context: ContextVar[Mapping[str, object]] = ContextVar("batchery_log_context", default=MappingProxyType({}))


def log_format() -> str:
    """``BATCHERY_LOG_FORMAT``: ``text`` (default) or ``json``; anything else is refused, naming the variable."""
    value = LOG_FORMAT.read()
    if value not in LOG_FORMATS:
        raise ImproperlyConfiguredEnv(f"BATCHERY_LOG_FORMAT={value!r} is not one of {', '.join(LOG_FORMATS)}")
    return value


def _known(fields: Mapping[str, object]) -> dict[str, object]:
    reserved = _RECORD_ATTRIBUTES.intersection(fields)
    if reserved:
        raise ValueError(f"log context fields {sorted(reserved)} would overwrite attributes of every log record")
    # "Where known": a field of None is left out rather than written as null.
    return {name: value for name, value in fields.items() if value is not None}


def current_log_context() -> dict[str, object]:
    """The fields every record logged here and now carries."""
    return dict(_context.get())


def bind_log_context(**fields: object) -> None:
    """Add fields to the log context until `clear_log_context` (for code with a start and an end
    in different callbacks, such as Celery's task_prerun and task_postrun)."""
    _context.set({**_context.get(), **_known(fields)})


def clear_log_context() -> None:
    """Drop every field of the log context (the end of a task, say)."""
    _context.set({})


@contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Add fields to every record logged inside the block; the context before it comes back after."""
    token = _context.set({**_context.get(), **_known(fields)})
    try:
        yield
    finally:
        _context.reset(token)


class LogContextFilter(logging.Filter):
    """Put the log context and this process's ``host`` and ``slot`` on each record the handler writes.

    Fields given in a call's ``extra`` win over the context. Attach it to handlers, not loggers: a
    logger's filters see only the records logged on that very logger, not those of its children.
    """

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        # Read once: a process's host and slot do not change (the launcher sets BATCHERY_SLOT per slot).
        self.static: dict[str, object] = {"host": socket.gethostname()}
        slot = slot_name()
        if slot:
            self.static["slot"] = slot

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in (*_context.get().items(), *self.static.items()):
            if not hasattr(record, name):
                setattr(record, name, value)
        return True


class JsonFormatter(_PythonJsonFormatter):
    """One JSON object a line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, then every
    other field of the record (context, ``host``, ``slot``, a call's ``extra``) and ``exc_info`` text."""

    def __init__(self) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
        )

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        # Set first so that it leads each line; a log system's parser finds it without reading the rest.
        log_data["time"] = datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")
        super().add_fields(log_data, record, message_dict)


def env_formatter() -> logging.Formatter:
    """The formatter ``BATCHERY_LOG_FORMAT`` asks for (a factory for ``logging.config.dictConfig``).

    In json mode it also sends Python's warnings through logging: printed by themselves they are
    lines that are not JSON, and the portal's ``LOGGING`` (which Django hands to dictConfig) has no
    other place to say so.
    """
    if log_format() != "json":
        return logging.Formatter(TEXT_FORMAT)
    logging.captureWarnings(True)
    return JsonFormatter()


def json_line(logger: str, level: int, message: str) -> str:
    """One JSON log line built without a handler, for code that runs in a signal handler: there,
    logging's locks and buffered streams may be in the middle of the write the signal interrupted."""
    record = logging.makeLogRecord(
        {"name": logger, "levelno": level, "levelname": logging.getLevelName(level), "msg": message}
    )
    LogContextFilter().filter(record)
    return JsonFormatter().format(record)


def _log_uncaught(kind: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("batchery.uncaught").critical("uncaught exception", exc_info=(kind, value, traceback))


def configure_logging(level: str | int = "INFO", *, stream: IO[str] | None = None) -> None:
    """Make the root logger write to ``stream`` (stderr) in the format ``BATCHERY_LOG_FORMAT`` names,
    replacing any handler it had.

    In json mode, warnings and a crash's traceback go through logging too: printed by themselves
    they would be lines that are not JSON.
    """
    formatter = env_formatter()
    handler = _handler(formatter, stream)
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    if isinstance(formatter, JsonFormatter):
        sys.excepthook = _log_uncaught
        # Records of a logger that does not propagate and has no handler (billiard's, for one) go to
        # Python's last resort, which writes bare messages; this one writes JSON, at the same level.
        logging.lastResort = _handler(formatter, stream, level=logging.WARNING)


def _handler(formatter: logging.Formatter, stream: IO[str] | None, *, level: int = logging.NOTSET) -> logging.Handler:
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(LogContextFilter())
    handler.setLevel(level)
    return handler
