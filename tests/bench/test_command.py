"""`manage.py bench`: what it prints around the parts it runs."""

from __future__ import annotations

import argparse
import io
import os
import shlex
from pathlib import Path

import pytest
import redis
from django.conf import settings

from bench.management.commands.bench import PARTS, Command, rerun_line, sentence_counts, shared_broker
from portal.devstack.stack import repoint_celery_app
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


def test_a_repointed_app_sends_to_and_stores_results_in_the_redis_it_points_at_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The result backend is built from the settings of its first use: repointing builds it again, or a
    process that used a Redis of its own and came back went on subscribing to the first (which a test
    stopped: every later send in that process failed)."""
    before = app.conf.result_backend
    app.backend.client.ping()  # built now, for the app's own Redis, and the broker's pool
    with app.pool.acquire(block=True):
        pass
    base, db = before.rsplit("/", 1)
    other = (int(db) + 1) % 16
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.setenv(name, f"{base}/{other}")
    try:
        repoint_celery_app()
        assert app.backend.client.connection_pool.connection_kwargs["db"] == other
        with app.pool.acquire(block=True) as connection:
            assert connection.as_uri().endswith(f"/{other}"), "the broker's pool too"
    finally:
        monkeypatch.undo()
        repoint_celery_app()
    assert app.backend.url == before


def test_the_stack_is_measured_at_each_target_size_by_default() -> None:
    options = Command().create_parser("manage.py", "bench").parse_args([])

    assert options.sentences == [6_000, 20_000, 100_000]


def test_sentence_counts_are_read_from_a_list_and_zero_skips() -> None:
    assert sentence_counts("6000, 20000") == [6_000, 20_000]
    assert sentence_counts("0") == []
    for bad in ("", "6000,x", "-5", "6000,0"):
        with pytest.raises(argparse.ArgumentTypeError, match="sentence counts"):
            sentence_counts(bad)


@pytest.mark.parametrize("part", [part.replace("-", "_") for part in PARTS])
def test_a_rerun_line_runs_its_part_alone(part: str) -> None:
    line = rerun_line(**{part: 7})
    parser = Command().create_parser("manage.py", "bench")

    options = vars(parser.parse_args(shlex.split(line.removeprefix("rerun: python manage.py bench "))))

    assert options["skip_io"]
    names = [name.replace("-", "_") for name in PARTS]
    expected: dict[str, object] = {**dict.fromkeys(names, 0), "sentences": []}
    expected[part] = [7] if part == "sentences" else 7
    assert {name: options[name] for name in names} == expected


def test_a_rerun_line_refuses_what_is_not_a_part() -> None:
    with pytest.raises(ValueError, match="not a part of the benchmark: slots"):
        rerun_line(slots=2)


def test_batchery_against_vllm_run_batch_runs_5000_requests_by_default_and_0_skips_it() -> None:
    options = Command().create_parser("manage.py", "bench").parse_args([])
    out = io.StringIO()

    Command(stdout=out).vllm_bench({"vllm_requests": 0, "vllm_model_dir": None})

    assert (options.vllm_requests, options.vllm_model_dir, options.only_vllm) == (5_000, None, False)
    assert out.getvalue() == ""
