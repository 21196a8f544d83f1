"""A compressed input is read only as far as the decompression limits allow: a bomb of a few hundred
KB stops at the limit, naming it, with no more than about the limit written or held."""

from __future__ import annotations

import gzip
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest

from tasks.shared.formats.compression import DecompressionLimitExceeded, DecompressionLimits
from tasks.shared.formats.inputs import InputOptions, check_input, iter_records
from tasks.shared.formats.jsonl import JsonlCheck
from tests.support.bombs import BOMB_BYTES, LINE, MiB, gzip_bomb, written_bytes, zstd_bomb

NO_RATIO = 1e12


def _opener(path: Path) -> Callable[[], BinaryIO]:
    return lambda: path.open("rb")


def _read_all(path: Path, limits: DecompressionLimits | None) -> JsonlCheck:
    check = JsonlCheck()
    for _ in iter_records(
        _opener(path), uri=path.as_uri(), options=InputOptions(), input_field="input", check=check, limits=limits
    ):
        pass
    return check


def test_a_gzip_bomb_stops_at_the_size_limit_naming_its_setting(tmp_path: Path) -> None:
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip_bomb())
    assert path.stat().st_size < 400 * 1024
    limits = DecompressionLimits(max_bytes=8 * MiB, max_ratio=NO_RATIO)
    check = JsonlCheck()
    with pytest.raises(DecompressionLimitExceeded) as refused:
        for _ in iter_records(
            _opener(path), uri=path.as_uri(), options=InputOptions(), input_field="input", check=check, limits=limits
        ):
            pass
    assert refused.value.setting == "BATCHERY_MAX_DECOMPRESSED_BYTES"
    assert refused.value.limit == 8 * MiB
    assert "8388608 bytes" in str(refused.value) and "BATCHERY_MAX_DECOMPRESSED_BYTES" in str(refused.value)
    # Records came out of the first 8 MiB only.
    assert check.records * len(LINE) <= 8 * MiB


def test_a_zstd_bomb_stops_at_the_ratio_once_past_its_first_bytes(tmp_path: Path) -> None:
    path = tmp_path / "bomb.jsonl.zst"
    path.write_bytes(zstd_bomb())
    assert path.stat().st_size < 400 * 1024
    limits = DecompressionLimits(max_bytes=BOMB_BYTES * 2, max_ratio=100, ratio_after=4 * MiB)
    with pytest.raises(DecompressionLimitExceeded) as refused:
        _read_all(path, limits)
    assert refused.value.setting == "BATCHERY_MAX_COMPRESSION_RATIO"
    assert "more than 100 times" in str(refused.value)


def test_a_small_file_that_compresses_well_is_not_refused_by_the_ratio(tmp_path: Path) -> None:
    path = tmp_path / "repeated.jsonl.gz"
    path.write_bytes(gzip.compress(LINE * 250))  # about 1 MiB, a few KB compressed
    check = _read_all(path, DecompressionLimits(max_bytes=BOMB_BYTES, max_ratio=100, ratio_after=4 * MiB))
    assert check.ok and check.records == 250


def test_a_parquet_bomb_in_gzip_is_spilled_no_further_than_the_limit(tmp_path: Path) -> None:
    # The format comes from the name: the spill copies it whole before pyarrow reads its footer.
    path = tmp_path / "bomb.parquet.gz"
    path.write_bytes(gzip_bomb(first=b"PAR1", filler=b"\0"))
    assert path.stat().st_size < 400 * 1024
    limit = 16 * MiB
    written = written_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(DecompressionLimitExceeded):
            _read_all(path, DecompressionLimits(max_bytes=limit, max_ratio=NO_RATIO))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert written_bytes() - written <= limit + 2 * MiB
    assert peak < 8 * MiB


def test_the_operators_settings_bound_every_reader_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHERY_MAX_DECOMPRESSED_BYTES", str(2 * MiB))
    path = tmp_path / "bomb.jsonl.zst"
    path.write_bytes(zstd_bomb(total=32 * MiB))
    with pytest.raises(DecompressionLimitExceeded, match="BATCHERY_MAX_DECOMPRESSED_BYTES"):
        check_input(_opener(path), uri=path.as_uri(), options=InputOptions(), input_field="input")


def test_a_quota_lower_than_the_setting_is_the_limit_named() -> None:
    limits = DecompressionLimits(max_bytes=10 * MiB, max_ratio=100)
    capped = limits.capped(MiB, setting="quota max_input_bytes")
    assert (capped.max_bytes, capped.bytes_setting) == (MiB, "quota max_input_bytes")
    assert limits.capped(None, setting="quota max_input_bytes") is limits
    assert limits.capped(20 * MiB, setting="quota max_input_bytes") is limits
