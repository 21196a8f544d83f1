"""`manage.py bench`: what it prints around the parts it runs."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import redis
from django.conf import settings

from portal.ops.management.commands.bench import Command, shared_broker
from portal.ops.stack import repoint_celery_app
from tasks.app import app


def test_the_platform_bench_prints_no_rerun_line_when_every_part_is_skipped() -> None:
    out = io.StringIO()

    Command(stdout=out).platform_bench({"ceiling_slots": 0, "api_jobs": 0, "reconcile_jobs": 0})

    assert out.getvalue() == ""


def test_the_shared_broker_leaves_the_environment_as_it_found_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settings, "VAR_DIR", tmp_path)
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    try:
        with shared_broker():
            url = os.environ["CELERY_BROKER_URL"]
            assert os.environ["CELERY_RESULT_BACKEND"] == url
            assert redis.Redis.from_url(url).ping()
            assert app.conf.broker_url == url

        # The embedded Redis is stopped: nothing after the block (the planning bench's processes,
        # which inherit the environment) may be pointed at it.
        assert "CELERY_BROKER_URL" not in os.environ and "CELERY_RESULT_BACKEND" not in os.environ
        assert app.conf.broker_url != url
    finally:
        monkeypatch.undo()
        repoint_celery_app()
