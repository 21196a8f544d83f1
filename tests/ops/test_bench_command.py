"""`manage.py bench`: what it prints around the parts it runs."""

from __future__ import annotations

import io

from portal.ops.management.commands.bench import Command


def test_the_platform_bench_prints_no_rerun_line_when_every_part_is_skipped() -> None:
    out = io.StringIO()

    Command(stdout=out).platform_bench({"ceiling_slots": 0, "api_jobs": 0, "reconcile_jobs": 0})

    assert out.getvalue() == ""
