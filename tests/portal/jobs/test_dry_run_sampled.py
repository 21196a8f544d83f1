"""A dry run answers within a web request: it reads a prefix of a large input, no more than its
records, bytes and seconds allow, and extrapolates to the whole input, saying so and on what basis."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from portal.catalog.models import Model
from portal.execution import plan
from portal.jobs.requests import InputTooLarge, JobRequest
from portal.jobs.services.dry_run import job_dry_run
from portal.tenancy.models import Tenant
from tests.support.bombs import zstd_bomb

RECORDS = 40_000


class _Counted(io.RawIOBase):
    def __init__(self, raw: BinaryIO, read: list[int]) -> None:
        super().__init__()
        self._raw = raw
        self._read = read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._raw.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        buffer[: len(data)] = data
        self._read.append(len(data))
        return len(data)


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every read of a job's input, in bytes, as the file gives them."""
    read: list[int] = []
    opened = plan.input_open
    monkeypatch.setattr(plan, "input_open", lambda uri: io.BufferedReader(_Counted(opened(uri), read)))
    return read


@pytest.fixture
def large_input(write_jsonl: Callable[..., Path]) -> Path:
    return write_jsonl([{"custom_id": f"r{n}", "input": "hello hello hello"} for n in range(RECORDS)])


def test_a_large_input_is_read_to_the_records_limit_and_extrapolated_by_its_bytes(
    acme: Tenant, minilm: Model, large_input: Path, settings: Any, bytes_read: list[int]
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0  # too large to count at submission
    settings.BATCHERY_DRY_RUN_MAX_RECORDS = 500
    report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(large_input)))
    size = large_input.stat().st_size
    assert sum(bytes_read) < size / 20  # a prefix: 500 records and the readers' buffers
    assert report.sampled and report.sample is not None
    assert (report.records, report.sample.records, report.sample.stopped_by) == (
        500,
        500,
        "BATCHERY_DRY_RUN_MAX_RECORDS",
    )
    assert report.sample.basis == "bytes" and report.sample.input_bytes_read <= sum(bytes_read)
    assert report.estimated_records == pytest.approx(RECORDS, rel=0.2)
    assert report.input_tokens == 500 * 5
    assert report.estimated_input_tokens == pytest.approx(RECORDS * 5, rel=0.2)
    assert report.shards.listed == () and report.shards.count >= 1
    assert report.quota == () or all(line.adds is None for line in report.quota if line.quota == "max_queued_records")


def test_the_bytes_limit_ends_the_prefix_too(
    acme: Tenant, minilm: Model, large_input: Path, settings: Any, bytes_read: list[int]
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    settings.BATCHERY_DRY_RUN_MAX_BYTES = 64 * 1024
    report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(large_input)))
    # The limit, and the first buffer read again once the format is known from its first bytes.
    assert sum(bytes_read) <= 64 * 1024 + 1 + 8192
    assert report.sample is not None and report.sample.stopped_by == "BATCHERY_DRY_RUN_MAX_BYTES"
    assert 0 < report.records < RECORDS
    assert report.estimated_records == pytest.approx(RECORDS, rel=0.2)


def test_an_input_counted_at_submission_is_counted_exactly_and_tokenized_only_to_the_limit(
    acme: Tenant, minilm: Model, large_input: Path, settings: Any
) -> None:
    assert large_input.stat().st_size <= settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES
    settings.BATCHERY_DRY_RUN_MAX_RECORDS = 500
    report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(large_input)))
    assert report.sample is not None and report.sample.basis == "records"
    assert (report.records, report.estimated_records) == (500, RECORDS)
    assert report.input_tokens == 500 * 5 and report.estimated_input_tokens == RECORDS * 5


def test_a_small_input_is_read_whole_and_not_sampled(
    acme: Tenant, minilm: Model, write_jsonl: Callable[..., Path]
) -> None:
    path = write_jsonl([{"custom_id": f"r{n}", "input": "hello hello hello"} for n in range(30)])
    report = job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
    assert (report.sampled, report.sample, report.records, report.estimated_records) == (False, None, 30, 30)
    assert report.estimated_input_tokens == report.input_tokens == 30 * 5


def test_a_dry_run_of_a_bomb_is_refused_naming_the_limit(
    acme: Tenant, minilm: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHERY_MAX_DECOMPRESSED_BYTES", str(4 * 1024 * 1024))
    path = tmp_path / "bomb.jsonl.zst"
    path.write_bytes(zstd_bomb())
    with pytest.raises(InputTooLarge, match="BATCHERY_MAX_DECOMPRESSED_BYTES"):
        job_dry_run(tenant=acme, request=JobRequest(model_name=minilm.name, input_uri=str(path)))
