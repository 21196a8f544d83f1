"""`make demo`'s code path on a machine with nothing configured: embedded Redis, SQLite, real workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.workers import newcomer_env

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_demo_runs_a_real_job_with_no_broker_or_database_configured(tmp_path: Path) -> None:
    env = newcomer_env(tmp_path / "var")

    finished = subprocess.run(
        [sys.executable, "manage.py", "demo", "--sentences", "400", "--cpu-slots", "1", "--timeout", "240"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    out = finished.stdout
    assert "status           succeeded" in out
    assert "records          400 (400 succeeded, 0 failed)" in out
    assert "(384 dimensions)" in out
    assert (tmp_path / "var" / "batchery.sqlite3").exists(), "the demo used the local SQLite database"
    assert (tmp_path / "var" / "redis" / "redis.log").exists(), "the demo started its embedded Redis"
    output_files = list((tmp_path / "var" / "storage" / "jobs").glob("*/output.jsonl"))
    assert len(output_files) == 1
    assert len(output_files[0].read_text().splitlines()) == 400
