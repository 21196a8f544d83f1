"""`make demo`'s code path on a machine with nothing configured: embedded Redis, SQLite, real workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.workers import manage_as_newcomer

pytestmark = pytest.mark.slow


def test_the_demo_runs_a_real_job_with_no_broker_or_database_configured(tmp_path: Path) -> None:
    out = manage_as_newcomer(
        "demo", "--sentences", "400", "--cpu-slots", "1", "--timeout", "240", var_dir=tmp_path / "var"
    )
    assert "status           succeeded" in out
    assert "records          400 (400 succeeded, 0 failed)" in out
    assert "(384 dimensions)" in out
    assert (tmp_path / "var" / "batchery.sqlite3").exists(), "the demo used the local SQLite database"
    assert (tmp_path / "var" / "redis" / "redis.log").exists(), "the demo started its embedded Redis"
    output_files = list((tmp_path / "var" / "storage" / "jobs").glob("*/output.jsonl"))
    assert len(output_files) == 1
    assert len(output_files[0].read_text().splitlines()) == 400
