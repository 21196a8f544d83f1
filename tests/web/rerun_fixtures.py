"""A finished job and its finished re-run with hand-written outputs, for the comparison page's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from portal.catalog.models import Model
from portal.jobs.models import Job
from portal.tenancy.models import Tenant
from tests.factories import ModelFactory
from tests.web.conftest import make_job

OLD_TEXTS = ["the cat sat", "a dog ran", "same text", "hello world", "blue sky", "x"]
NEW_TEXTS = ["the cat sat", "a dog walked", "same text", "goodbye world", "green sea", "x"]


def _output(path: Path, texts: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        b"".join(
            orjson.dumps({"custom_id": str(n), "response": {"text": text, "finish_reason": "stop"}}) + b"\n"
            for n, text in enumerate(texts, start=1)
        )
    )
    return path.as_uri()


def rerun_pair(tenant: Tenant, tmp_path: Path) -> tuple[Job, Job]:
    """A generation job and its re-run, both succeeded, their outputs under `tmp_path`."""
    model: Any = ModelFactory(
        name="echo-gen",
        engine=Model.Engine.PYTHON,
        task=Model.Task.GENERATE,
        source="tests.support.chaos_engines:echo_factory",
        is_default=False,
    )
    old = make_job(tenant, model, total_records=6, output_uri=_output(tmp_path / "old" / "output.jsonl", OLD_TEXTS))
    new = make_job(
        tenant,
        model,
        total_records=6,
        rerun_of=old,
        output_uri=_output(tmp_path / "new" / "output.jsonl", NEW_TEXTS),
    )
    return old, new
