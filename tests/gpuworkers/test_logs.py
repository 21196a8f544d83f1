"""Log lines: JSON objects with the job's fields when BATCHERY_LOG_FORMAT=json, today's text otherwise."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from gpuworkers.logs import (
    TEXT_FORMAT,
    bind_log_context,
    clear_log_context,
    configure_logging,
    current_log_context,
    log_context,
    log_format,
)
from tasks.shared.env import ImproperlyConfiguredEnv


@pytest.fixture
def output(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """The root logger writes here, in json mode; whatever logging looked like before comes back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    excepthook, last_resort = sys.excepthook, logging.lastResort
    monkeypatch.setenv("BATCHERY_LOG_FORMAT", "json")
    monkeypatch.setenv("BATCHERY_SLOT", "3")
    stream = io.StringIO()
    configure_logging("DEBUG", stream=stream)
    try:
        yield stream
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        sys.excepthook, logging.lastResort = excepthook, last_resort
        logging.captureWarnings(False)
        clear_log_context()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_each_record_is_one_json_object_with_time_level_logger_message_host_and_slot(output: io.StringIO) -> None:
    logging.getLogger("batchery.test").info("shard %d of %s", 2, "job-1")

    (line,) = lines(output)
    assert list(line)[:4] == ["time", "level", "logger", "message"]
    assert line["level"] == "INFO"
    assert line["logger"] == "batchery.test"
    assert line["message"] == "shard 2 of job-1"
    assert datetime.fromisoformat(line["time"]).utcoffset() is not None, "the time says its zone"
    assert line["host"]
    assert line["slot"] == "3"


def test_context_fields_appear_inside_the_block_and_are_gone_after_it(output: io.StringIO) -> None:
    logger = logging.getLogger("batchery.test")
    with log_context(job_id="job-1", tenant="acme"):
        with log_context(shard=4):
            logger.info("inner")
        logger.info("outer")
    logger.info("after")

    inner, outer, after = lines(output)
    assert (inner["job_id"], inner["tenant"], inner["shard"]) == ("job-1", "acme", 4)
    assert "shard" not in outer and outer["job_id"] == "job-1"
    assert not {"job_id", "tenant", "shard"} & set(after)


def test_bound_fields_stay_until_cleared_and_unknown_ones_are_left_out(output: io.StringIO) -> None:
    logger = logging.getLogger("batchery.test")
    bind_log_context(job_id="job-2", shard=0, tenant=None)
    logger.info("bound")
    clear_log_context()
    logger.info("cleared")

    bound, cleared = lines(output)
    assert (bound["job_id"], bound["shard"]) == ("job-2", 0)
    assert "tenant" not in bound
    assert "job_id" not in cleared
    assert current_log_context() == {}


def test_a_calls_extra_wins_over_the_context(output: io.StringIO) -> None:
    with log_context(job_id="outer-job"):
        logging.getLogger("batchery.test").info("other job", extra={"job_id": "other-job"})

    assert lines(output)[0]["job_id"] == "other-job"


def test_another_thread_does_not_see_this_threads_context(output: io.StringIO) -> None:
    with log_context(job_id="job-3"):
        thread = threading.Thread(target=logging.getLogger("batchery.test").info, args=("from a thread",))
        thread.start()
        thread.join()

    assert "job_id" not in lines(output)[0]


def test_a_context_field_may_not_overwrite_an_attribute_of_the_record() -> None:
    with pytest.raises(ValueError, match="message"), log_context(message="x"):
        pass


def test_an_exceptions_traceback_is_in_exc_info(output: io.StringIO) -> None:
    try:
        raise RuntimeError("engine fell over")
    except RuntimeError:
        logging.getLogger("batchery.test").exception("shard failed")

    (line,) = lines(output)
    assert line["message"] == "shard failed"
    assert "Traceback" in line["exc_info"]
    assert "RuntimeError: engine fell over" in line["exc_info"]


def test_python_warnings_are_logged_as_json(output: io.StringIO) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old knob", UserWarning, stacklevel=1)

    (line,) = lines(output)
    assert (line["level"], line["logger"]) == ("WARNING", "py.warnings")
    assert "old knob" in line["message"]


def test_a_logger_without_handlers_that_does_not_propagate_still_writes_json(output: io.StringIO) -> None:
    lonely = logging.getLogger("batchery.test.lonely")
    lonely.propagate = False
    try:
        lonely.warning("nobody handles me")
    finally:
        lonely.propagate = True

    assert lines(output)[0]["message"] == "nobody handles me"


def test_text_is_the_default_and_keeps_todays_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHERY_LOG_FORMAT", raising=False)
    assert log_format() == "text"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    try:
        configure_logging("INFO", stream=stream)
        with log_context(job_id="job-4"):
            logging.getLogger("batchery.test").info("plain")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s %(message)s"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO batchery.test plain\n", stream.getvalue())


@pytest.mark.parametrize("value", ["xml", "JSONL", "text json"])
def test_an_unknown_format_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BATCHERY_LOG_FORMAT", value)
    with pytest.raises(ImproperlyConfiguredEnv, match="BATCHERY_LOG_FORMAT"):
        log_format()
    with pytest.raises(ImproperlyConfiguredEnv, match="BATCHERY_LOG_FORMAT"):
        configure_logging("INFO", stream=io.StringIO())
