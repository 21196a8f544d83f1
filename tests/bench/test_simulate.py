"""`manage.py simulate` at a small size: virtual slots drive the real control plane end to end.

The run starts its own control worker and two fleet processes on an embedded Redis and the test
database; the test reads back what the product wrote (shard rows settled by `shard_done`, commit
markers in storage, outputs merged) besides the run's own RESULT line.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from django.core.management import call_command
from django.db import connection

from portal.devstack.embedded import start_embedded_redis
from portal.devstack.stack import repoint_celery_app
from portal.jobs.models import Job, JobStatus, Shard, ShardStatus
from tests.support.workers import database_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.django_db(transaction=True)]

RESULT = re.compile(
    r"^RESULT slots=(\d+) endings_per_s=([0-9.]+) idle_gap_p99_s=([0-9.]+) "
    r"fair_share_max_deviation=([0-9.]+) lost=(\d+) duplicated=(\d+)$",
    re.M,
)


@pytest.fixture
def own_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An embedded Redis of the run's own: no other worker of the session takes its control tasks."""
    redis = start_embedded_redis(tmp_path / "redis")
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.setenv(name, redis.url)
    repoint_celery_app()
    try:
        yield redis.url
    finally:
        monkeypatch.undo()
        repoint_celery_app()
        redis.stop()


def test_a_small_simulated_fleet_drives_the_real_control_plane_and_loses_nothing(
    own_redis: str, tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.VAR_DIR = tmp_path
    monkeypatch.setenv("DATABASE_URL", database_url(connection.settings_dict))
    monkeypatch.setenv("BATCHERY_VAR_DIR", str(tmp_path))
    out = io.StringIO()
    call_command(
        "simulate",
        *("--slots", "8", "--tenants", "4", "--shard-seconds", "2", "--minutes", "1"),
        *("--fleet-processes", "2", "--small-jobs-per-s", "0.5", "--warmup-s", "5"),
        stdout=out,
    )
    text = out.getvalue()
    match = RESULT.search(text)
    assert match, text
    slots, endings_per_s, _, _, lost, duplicated = match.groups()
    assert (int(slots), int(lost), int(duplicated)) == (8, 0, 0), text
    assert float(endings_per_s) > 0, text
    lengths = re.search(r"^shard length on a slot: mean / p50 \(s\) +([0-9.]+) / ([0-9.]+)", text, re.M)
    assert lengths and 0 < float(lengths[1]) <= 10, text

    jobs = Job.objects.filter(tenant__name__startswith="sim-")
    assert jobs.exists() and not jobs.exclude(status__in=[JobStatus.SUCCEEDED, JobStatus.CANCELLED]).exists()
    # The slots' shards were settled by the control plane's callbacks, from commit markers the slots
    # wrote, under the virtual slots' worker names.
    done = Shard.objects.filter(job__in=jobs, status=ShardStatus.SUCCEEDED)
    assert done.exists(), text
    for shard in done[:20]:
        marker = Path(shard.prefix_uri.removeprefix("file://")) / "commit.json"
        manifest = orjson.loads(marker.read_bytes())
        assert manifest["attempt_id"] == shard.attempt_id
        assert shard.worker.startswith("sim") and "@sim-" in shard.worker
    # The faults were injected, and every kind shows in the table.
    assert "vanish, slow, drain, broker_loss" in text
    events = [
        orjson.loads(line)
        for path in (tmp_path / "simulate").glob("fleet*.events.jsonl")
        for line in path.read_bytes().splitlines()
    ]
    assert {event["worker"].split("@")[1][:7] for event in events if "task" in event} >= {"sim-h10", "sim-t4-"}
