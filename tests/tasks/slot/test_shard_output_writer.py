"""A shard's output lines are written on a thread while the model runs: same bytes, same failures."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from tasks.shared.storage import TransientStorageError
from tasks.shared.storage.local import LocalStore
from tasks.slot import shard_execution
from tasks.slot.shard_execution import OutputLine, _BlockWriter, _write_outputs


def _lines(count: int) -> list[OutputLine]:
    return [OutputLine(b'{"custom_id":"r%d"}\n' % n, "bad_input" if n % 3 == 0 else None, 2, 1) for n in range(count)]


def _uris(tmp_path: Path) -> dict[str, str]:
    return {"output_uri": (tmp_path / "out.jsonl").as_uri(), "errors_uri": (tmp_path / "errors.jsonl").as_uri()}


def test_lines_are_written_in_order_across_many_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_BlockWriter, "BLOCK_BYTES", 64)
    monkeypatch.setattr(_BlockWriter, "QUEUED_BLOCKS", 2)
    lines = _lines(1000)

    counts, codes = _write_outputs(LocalStore(), iter(lines), **_uris(tmp_path))

    assert (tmp_path / "out.jsonl").read_bytes() == b"".join(line.data for line in lines)
    assert (tmp_path / "errors.jsonl").read_bytes() == b"".join(line.data for line in lines if line.error_code)
    assert counts == {
        "records": 1000,
        "failed": 334,
        "prompt_tokens": 2000,
        "completion_tokens": 1000,
        "cached_prompt_tokens": 0,
    }
    assert codes == {"bad_input": 334}


def test_a_soft_time_limit_in_the_model_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_BlockWriter, "BLOCK_BYTES", 64)

    def lines() -> Iterator[OutputLine]:
        yield from _lines(100)
        raise SoftTimeLimitExceeded()

    with pytest.raises(SoftTimeLimitExceeded):
        _write_outputs(LocalStore(), lines(), **_uris(tmp_path))

    assert list(tmp_path.iterdir()) == []


class _Unreachable(io.BytesIO):
    def write(self, data: Any) -> int:
        raise TransientStorageError("S3 unavailable while writing")


class _StoreThatFailsErrors(LocalStore):
    @contextmanager
    def open_write(self, uri: str) -> Iterator[BinaryIO]:
        with super().open_write(uri) as handle:
            yield _Unreachable() if uri.endswith("errors.jsonl") else handle


def test_a_write_that_fails_on_the_thread_is_raised_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_BlockWriter, "BLOCK_BYTES", 64)
    monkeypatch.setattr(_BlockWriter, "QUEUED_BLOCKS", 1)

    with pytest.raises(TransientStorageError):
        _write_outputs(_StoreThatFailsErrors(), iter(_lines(1000)), **_uris(tmp_path))

    assert list(tmp_path.iterdir()) == []


def test_an_output_smaller_than_a_block_is_written_in_the_caller_without_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []

    class RecordedThread(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(shard_execution.threading, "Thread", RecordedThread)
    lines = _lines(10)

    counts, _ = _write_outputs(LocalStore(), iter(lines), **_uris(tmp_path))

    assert started == []
    assert (tmp_path / "out.jsonl").read_bytes() == b"".join(line.data for line in lines)
    assert (tmp_path / "errors.jsonl").read_bytes() == b"".join(line.data for line in lines if line.error_code)
    assert counts["records"] == 10

    monkeypatch.setattr(_BlockWriter, "BLOCK_BYTES", 64)
    _write_outputs(LocalStore(), iter(lines), **_uris(tmp_path))
    assert started == ["shard output writer"], "a full block starts the thread"


def test_a_small_output_whose_write_fails_is_raised_and_publishes_nothing(tmp_path: Path) -> None:
    with pytest.raises(TransientStorageError):
        _write_outputs(_StoreThatFailsErrors(), iter(_lines(10)), **_uris(tmp_path))

    assert list(tmp_path.iterdir()) == []


def test_an_output_without_error_lines_writes_no_error_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fine = [line._replace(error_code=None) for line in _lines(300)]
    for block_bytes in (64, _BlockWriter.BLOCK_BYTES):  # on the thread, and in the caller
        monkeypatch.setattr(_BlockWriter, "BLOCK_BYTES", block_bytes)

        counts, codes = _write_outputs(LocalStore(), iter(fine), **_uris(tmp_path))

        assert (counts["failed"], codes) == (0, {})
        assert sorted(path.name for path in tmp_path.iterdir()) == ["out.jsonl"]
