"""Fixtures shared by the whole suite: personas, the catalog, JSONL inputs and real workers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.factories import ModelFactory, TenantFactory
from tests.support.moto_server import running_moto_server
from tests.support.tcp_proxy import TcpProxy, tcp_proxy
from tests.support.workers import WorkerProcess, database_url, start_worker, stop_workers, wait_until_consuming

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that share the session's pipeline workers run last, whole and in their order.

    Those workers consume the real control queue on the test database: started early, they would
    also take the merges and ticks that other tests' code sends while running in-process, and write
    to the database while those tests' teardown truncates it (a deadlock, and a test that fails
    after it on rows left behind)."""
    shared = {
        getattr(item, "module", None) for item in items if "pipeline_workers" in getattr(item, "fixturenames", ())
    }
    items.sort(key=lambda item: getattr(item, "module", None) in shared)


@pytest.fixture
def acme(db: None) -> Any:
    """A tenant with the default quota."""
    return TenantFactory(name="acme")


@pytest.fixture
def minilm(db: None) -> Any:
    """The bundled default model, as the migration registers it (transactional tests flush it)."""
    return ModelFactory()


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Write records (dicts, or raw strings for bad lines) as a JSONL file."""

    def write(records: list[Any], name: str = "input.jsonl") -> Path:
        path = tmp_path / name
        with path.open("w") as handle:
            for record in records:
                handle.write(record if isinstance(record, str) else json.dumps(record))
                handle.write("\n")
        return path

    return write


@dataclass(frozen=True)
class S3Service:
    """A moto S3 server for the session, reached through a proxy that tests can take down."""

    server_url: str
    """moto itself, for setting up and inspecting buckets behind the workers' backs."""
    proxy: TcpProxy
    env: dict[str, str]
    """What a process needs to use it as its S3 endpoint."""


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    config = tmp_path_factory.mktemp("aws")
    with running_moto_server() as url, tcp_proxy(int(url.rsplit(":", 1)[1])) as proxy:
        env = {
            "AWS_ENDPOINT_URL": proxy.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            # Keep the machine's own AWS set-up out of the tests.
            "AWS_CONFIG_FILE": str(config / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(config / "credentials"),
        }
        yield S3Service(server_url=url, proxy=proxy, env=env)


@pytest.fixture
def s3(s3_service: S3Service, monkeypatch: pytest.MonkeyPatch) -> S3Service:
    """This process uses the session's S3 server too (a fresh store, so its client reads this env)."""
    from tasks.shared.storage import registry
    from tasks.shared.storage.s3 import S3Store

    for name, value in s3_service.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(registry, "_S3", S3Store())
    return s3_service


@pytest.fixture(scope="session")
def pipeline_workers(
    django_db_setup: None, django_db_blocker: Any, s3_service: S3Service
) -> Iterator[dict[str, WorkerProcess]]:
    """A real control worker, a planning worker, a webhooks worker, a validation worker and a real `gpu.cpu`
    worker, sharing the test database, broker and S3 server."""
    from django.db import connection

    from tasks.app import app

    app.control.purge()
    env = {**os.environ, **s3_service.env}
    env["DATABASE_URL"] = database_url(connection.settings_dict)
    env["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    # Webhook tests' receivers listen on 127.0.0.1, explicitly allowed; their retries come fast.
    env["BATCHERY_WEBHOOK_ALLOWED_HOSTS"] = "127.0.0.1"
    env["BATCHERY_WEBHOOK_RETRY_DELAYS_S"] = "0.2,0.2"
    # A slow receiver is cut within seconds; one place in flight a tenant, two senders: another
    # tenant's deliveries go on while one tenant's receiver is slow.
    env["BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S"] = "4"
    env["BATCHERY_WEBHOOK_MAX_IN_FLIGHT_PER_TENANT"] = "1"
    log_dir = ARTIFACTS / "logs"
    workers = {
        "control": start_worker("control", "control", env=env, log_dir=log_dir),
        "planning": start_worker("planning", "planning", env=env, log_dir=log_dir),
        "webhooks": start_worker("webhooks", "webhooks", env=env, log_dir=log_dir, concurrency=2),
        "validation": start_worker("validation", "validation", env=env, log_dir=log_dir),
        "cpu": start_worker(
            "cpu0", "gpu.cpu", env={**env, "BATCHERY_TORCH_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}, log_dir=log_dir
        ),
    }
    try:
        wait_until_consuming(list(workers.values()))
        yield workers
    finally:
        stop_workers(workers.values())
