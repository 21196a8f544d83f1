"""The planner resolves the adapters a large input's records name (one not checked at submission): each
shard's message carries them, and a record naming an adapter its tenant may not use fails the job, naming
the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portal.catalog.models import Adapter, Model
from portal.execution.dispatch import shard_spec
from portal.execution.plan import job_plan
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest
from portal.jobs.services.submit import job_submit
from tests.factories import ModelFactory, TenantFactory

pytestmark = pytest.mark.django_db


def _input(path: Path, models: list[str | None]) -> Path:
    with path.open("w") as handle:
        for n, model in enumerate(models):
            record: dict[str, Any] = {"custom_id": f"r{n}", "prompt": f"prompt {n}"}
            if model is not None:
                record["model"] = model
            handle.write(json.dumps(record) + "\n")
    return path


@pytest.fixture
def base(db: None) -> Model:
    return ModelFactory(
        name="plan-base", engine=Model.Engine.TRANSFORMERS, task=Model.Task.GENERATE, source="/x", is_default=False
    )


def _planned(tenant: Any, path: Path, captured: Any, **request: Any) -> Job:
    job = job_submit(tenant=tenant, request=JobRequest(model_name="plan-base", input_uri=str(path), **request))
    assert job.adapters == {}, "an input too large to check at submission is resolved by its planner"
    with captured():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    return job


def test_the_planner_saves_the_adapters_the_records_name_and_every_shard_carries_them(
    base: Model, tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    acme = TenantFactory(name="acme")
    own = Adapter.objects.create(name="alpha", base_model=base, owner=acme, source="/a", rank=8)
    Adapter.objects.create(name="beta", base_model=base, source="/b", rank=4)
    path = _input(tmp_path / "in.jsonl", [None, "alpha", "plan-base", "beta", "alpha", None])

    job = _planned(acme, path, django_capture_on_commit_callbacks, shard_size=2)

    assert job.status == JobStatus.RUNNING, job.error
    assert {name: entry["spec"]["rank"] for name, entry in job.adapters.items()} == {"alpha": 8, "beta": 4}
    assert job.adapters["alpha"]["id"] == own.pk
    for shard in job.shards.all():
        spec = shard_spec(job, shard)
        assert sorted(spec.adapters) == ["alpha", "beta"]
        assert spec.adapter == ""
    assert spec.adapters["alpha"].source == "/a"


def test_a_record_naming_another_tenants_adapter_fails_the_job_naming_its_line(
    base: Model, tmp_path: Path, settings: Any, django_capture_on_commit_callbacks: Any
) -> None:
    settings.BATCHERY_VALIDATE_ON_SUBMIT_MAX_BYTES = 0
    acme, globex = TenantFactory(name="acme"), TenantFactory(name="globex")
    Adapter.objects.create(name="secret", base_model=base, owner=globex, source="/s", rank=4)
    path = _input(tmp_path / "in.jsonl", [None, None, "secret"])

    job = _planned(acme, path, django_capture_on_commit_callbacks)

    assert job.status == JobStatus.FAILED
    assert "line 3: model 'secret' is neither the job's model 'plan-base' nor an adapter of it" in job.error
    assert job.adapters == {}
