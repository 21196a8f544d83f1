"""The API benchmark at a tiny size, as `make bench` runs it: a real portal under load, then profiled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.workers import manage_as_newcomer

pytestmark = pytest.mark.slow


def test_the_api_bench_reports_the_cpu_of_portal_and_clients_and_where_the_portals_time_goes(
    tmp_path: Path,
) -> None:
    parts = ["--sentences", "0", "--metrics-sentences", "0", "--fairness-slots", "0", "--ceiling-slots", "0"]
    load = [
        "--api-jobs",
        "300",
        "--api-clients",
        "4",
        "--api-seconds",
        "2",
        "--reconcile-jobs",
        "0",
        "--fleet-slots",
        "0",
        "--scheduler-jobs",
        "0",
        # The parts that run after the whole stack's: the API's figures alone.
        "--prefix-lines",
        "0",
        "--lora-records",
        "0",
        "--vllm-requests",
        "0",
    ]

    out = manage_as_newcomer("bench", "--skip-io", *parts, *load, var_dir=tmp_path / "var")

    assert "API: 4 clients, 300 jobs in the database" in out
    # A newcomer's database is SQLite: the retention part, left at its default, says why it is skipped.
    assert "retention: skipped, it measures PostgreSQL's tables and this database is sqlite" in out
    cpu = re.findall(r"CPU with (no pause|500 ms between requests): portal ([\d.]+) cores, clients ([\d.]+) cores", out)
    assert [pace for pace, _, _ in cpu] == ["no pause", "500 ms between requests"], out
    portal_cores, clients_cores = float(cpu[0][1]), float(cpu[0][2])
    assert portal_cores > 0.05 and clients_cores > 0.05, "both sides worked through the run with no pause"
    profile = re.search(r"profile of the portal, 4 clients with no pause \((\d+) samples", out)
    assert profile and int(profile[1]) > 0, out
    # Named by their command line, or by their title where setproctitle is installed (vLLM's CPU build brings it).
    assert re.search(r"^ +[\d.]+%  process gunicorn(: worker| portal\.wsgi)", out, re.MULTILINE), (
        "the samples came from the portal's processes"
    )
    assert re.search(r"^ +[\d.]+%  \w+ \(portal/", out, re.MULTILINE), "the portal's own code is in the profile"
    assert (
        "rerun: python manage.py bench --skip-io --sentences 0 --metrics-sentences 0 --fairness-slots 0 "
        "--ceiling-slots 0 --api-jobs 300 --reconcile-jobs 0" in out
    )
