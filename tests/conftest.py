"""Fixtures shared by the whole suite: personas, the catalog, JSONL inputs and real workers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.factories import ModelFactory, TenantFactory
from tests.support.workers import WorkerProcess, database_url, start_worker, wait_until_consuming

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


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


@pytest.fixture(scope="session")
def pipeline_workers(django_db_setup: None, django_db_blocker: Any) -> Iterator[dict[str, WorkerProcess]]:
    """A real control worker and a real `gpu.cpu` worker, sharing the test database and broker."""
    from django.db import connection

    from tasks.app import app

    app.control.purge()
    env = dict(os.environ)
    env["DATABASE_URL"] = database_url(connection.settings_dict)
    env["DJANGO_SETTINGS_MODULE"] = "portal.settings"
    log_dir = ARTIFACTS / "logs"
    workers = {
        "control": start_worker("control", "control", env=env, log_dir=log_dir),
        "cpu": start_worker(
            "cpu0", "gpu.cpu", env={**env, "BATCHERY_TORCH_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}, log_dir=log_dir
        ),
    }
    try:
        wait_until_consuming(list(workers.values()))
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()
