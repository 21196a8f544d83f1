"""PostgreSQL restarted mid-job: the portal answers 503 while it is down, then recovers, and the
job completes. The stack runs against a private cluster that the test may stop and start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from portal.devstack.embedded import free_port
from tests.chaos.conftest import ARTIFACTS, RESULTS, scale, wait_consuming
from tests.support.chaos import CHAOS_ENV, CONTROL_WORKERS, ChaosResult, ChaosStack, read_jsonl, wait_for, write_records
from tests.support.postgres import PrivatePostgres, available
from tests.support.workers import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.chaos,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not available(), reason="needs PostgreSQL's binaries (initdb, pg_ctl)"),
]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[tuple[ChaosStack, PrivatePostgres, str]]:
    cluster = PrivatePostgres.create()
    env = {**os.environ, **CHAOS_ENV, "DATABASE_URL": cluster.url, "DJANGO_SETTINGS_MODULE": "portal.settings"}
    stack = ChaosStack(
        env=env,
        data_dir=tmp_path / "chaos",
        log_dir=ARTIFACTS / "chaos-logs" / "database-restart",
        control_workers=CONTROL_WORKERS,
    )
    portal = None
    try:
        stack.start_redis()
        stack.manage("migrate", "--no-input", timeout_s=120)
        stack.manage(
            "shell", "-c",
            "from portal.catalog.models import GpuClass, Model; "
            "Model.objects.create(name='chaos-echo', engine='python', task='classify', "
            "source='tests.support.chaos_engines:echo_factory', gpu_class=GpuClass.objects.get(name='cpu'), "
            "default_params={'sleep_per_record': 0.03, 'time_limit_base_s': 8})",
        )  # fmt: skip
        stack.start_control()
        stack.start_shard_worker()
        wait_consuming(stack)
        port = free_port()
        portal = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "portal.wsgi", "--bind", f"127.0.0.1:{port}", "--workers", "1"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        health = f"http://127.0.0.1:{port}/healthz"
        wait_for(lambda: _status(health) == 200, timeout_s=30, what="the portal")
        yield stack, cluster, health
    finally:
        if portal is not None:
            portal.terminate()
            portal.wait(timeout=10)
        stack.stop()
        cluster.stop()
        cluster.remove()


def _job(cluster: PrivatePostgres, job_id: str) -> dict[str, object]:
    with psycopg.connect(cluster.url.replace("postgres://", "postgresql://"), autocommit=True) as conn:
        row = conn.execute("select status, output_uri, errors_uri from jobs_job where id = %s", (job_id,)).fetchone()
        events = [status for (status,) in conn.execute(
            "select status from jobs_jobevent where job_id = %s order by at, id", (job_id,)
        )]  # fmt: skip
    assert row is not None
    return {"status": row[0], "output_uri": row[1], "errors_uri": row[2], "events": events}


def test_postgres_restarted_mid_job_answers_503_then_recovers_and_the_job_completes(
    private_stack: tuple[ChaosStack, PrivatePostgres, str], tmp_path: Path
) -> None:
    stack, cluster, health = private_stack
    ids = write_records(tmp_path / "input.jsonl", [f"record {n}" for n in range(scale(150, 1500))])
    started = time.monotonic()
    job_id = stack.submit(model="chaos-echo", input_path=tmp_path / "input.jsonl", shard_size=15)
    wait_for(lambda: _job(cluster, job_id)["status"] == "running", timeout_s=60, what="running", stack=stack)

    cluster.stop()
    assert _status(health) == 503, "the portal says the database is unavailable, not 500"
    time.sleep(4)
    cluster.start()
    wait_for(lambda: _status(health) == 200, timeout_s=30, what="the portal to recover")

    finished = wait_for(
        lambda: (job := _job(cluster, job_id))["status"] in {"succeeded", "partially_succeeded", "failed"} and job,
        timeout_s=180, what="the job to end", stack=stack,
    )  # fmt: skip
    output = read_jsonl(str(finished["output_uri"]))
    errors = read_jsonl(str(finished["errors_uri"]))
    out_ids = [line["custom_id"] for line in output]
    RESULTS.append(
        ChaosResult(
            scenario="PostgreSQL restarted", records_in=len(ids), out=len(output), errors=len(errors),
            duplicates=len(out_ids) - len(set(out_ids)), lost=len(set(ids) - set(out_ids)),
            seconds=round(time.monotonic() - started, 1), status=str(finished["status"]), error_codes={},
        )
    )  # fmt: skip
    assert finished["status"] == "succeeded"
    assert out_ids == ids
    assert errors == []
    events = list(finished["events"])  # type: ignore[call-overload]
    assert [e for e in events if e in {"succeeded", "partially_succeeded", "failed"}] == ["succeeded"]
