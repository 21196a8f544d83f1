"""A job's provenance manifest, through the planner, the slot's shard body (`execute_shard`) and the merge, on
a tiny GPT-2 saved by the test: it names the weights' and tokenizer's digests, the engine's versions, the
parameters and every record's own by digest, the seed and the input's digest; shards that ran on other
weights under the same model name fail the job (or mark it, where the operator allows); a job pinned to
weights the fleet no longer has is refused, and a slot holding others refuses its shards. Real
PostgreSQL, Redis and files; no worker runs here."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from gpuworkers.cache import process_cache
from gpuworkers.weights.digest import model_digest
from portal.catalog.models import Model
from portal.execution.dispatch import shard_spec
from portal.execution.job_manifest import manifest_uri
from portal.execution.merge import job_merge
from portal.execution.plan import job_plan
from portal.execution.settle import shard_record_success
from portal.jobs.models import Job, JobStatus
from portal.jobs.requests import JobRequest, SubmissionError
from portal.jobs.services.submit import job_submit
from tasks.shared.digests import canonical_digest
from tasks.shared.specs import ShardManifest
from tasks.shared.storage import store_for
from tasks.slot.provenance import OtherWeights
from tasks.slot.shard_execution import execute_shard
from tests.factories import ModelFactory, TenantFactory
from tests.support.tiny_models import build_tiny_causal_lm

pytestmark = pytest.mark.django_db

PARAMS = {"max_tokens": 2, "temperature": 0.7, "seed": 7}
RECORDS = 12
OWN = {"max_tokens": 3}
"""The params every third record sets itself."""


@pytest.fixture
def model(tmp_path: Path, request: pytest.FixtureRequest) -> Model:
    # A name of its own: the warm cache of this process keys models by name and version.
    name = f"prov-{request.node.name[-40:]}"
    return ModelFactory(
        name=name,
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.GENERATE,
        source=str(build_tiny_causal_lm(tmp_path / "tiny")),
        is_default=False,
    )


@pytest.fixture
def input_path(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    records = [
        {"custom_id": f"r{n}", "prompt": f"Prompt {n}", **({"params": OWN} if n % 3 == 0 else {})}
        for n in range(RECORDS)
    ]
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return path


def planned(model: Model, input_path: Path, captured: Any, **request: Any) -> Job:
    job = job_submit(
        tenant=TenantFactory(),
        request=JobRequest(model_name=model.name, input_uri=str(input_path), shard_size=4, params=PARAMS, **request),
    )
    with captured():
        job_plan(job_id=str(job.id))
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING, job.error
    return job


def run_shards(job: Job, *, before_each: Any = lambda index: None) -> None:
    for shard in job.shards.order_by("index"):
        before_each(shard.index)
        manifest = execute_shard(shard_spec(job, shard), worker="w1")
        assert isinstance(manifest, ShardManifest)
        shard_record_success(shard, manifest)


def merged(job: Job, captured: Any) -> Job:
    with captured():
        job_merge(job_id=str(job.id))
    job.refresh_from_db()
    return job


def other_weights(model: Model) -> None:
    """Change one byte of the model's weights under the same catalog name and version, as a host whose files
    differ would hold them, and drop this process's warm copy so that the next shard loads them."""
    weights = next(Path(model.source).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    process_cache().clear()


def test_the_manifest_names_the_weights_tokenizer_engine_params_seed_and_input(
    model: Model, input_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    job = planned(model, input_path, django_capture_on_commit_callbacks)
    run_shards(job)
    job = merged(job, django_capture_on_commit_callbacks)

    assert job.status == JobStatus.SUCCEEDED, job.error
    manifest = job.provenance
    files = model_digest(model.to_spec())
    assert files is not None
    assert manifest["model"]["weights_digest"] == files.digest
    assert manifest["model"]["tokenizer_digest"] == files.tokenizer_digest
    assert manifest["model"]["files"] == files.files
    assert (manifest["model"]["name"], manifest["model"]["version"]) == (model.name, model.version)
    assert manifest["mixed_weights"] is False
    [versions] = manifest["engine"]["versions"]
    assert {"python", "batchery", "torch", "transformers"} <= set(versions["versions"])
    assert versions["shards"] == 3
    assert manifest["params"] == {**model.default_params, **PARAMS}, "the model's defaults under the job's"
    assert manifest["params_digest"] == canonical_digest(manifest["params"])
    assert manifest["record_params"] == {"records": 4, "digests": {canonical_digest(OWN): 4}}
    assert manifest["seed"] == 7
    assert manifest["input"]["digest"] == "sha256:" + hashlib.sha256(input_path.read_bytes()).hexdigest()
    assert manifest["input"]["records"] == RECORDS
    assert (manifest["hosts"], manifest["devices"], manifest["shards"]) == ([socket.gethostname()], ["cpu"], 3)
    # Written beside the output, as kept on the job.
    assert orjson.loads(store_for(manifest_uri(job)).read_bytes(manifest_uri(job))) == manifest


def test_shards_run_on_other_weights_under_the_same_name_fail_the_job_naming_each_digest(
    model: Model, input_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    before = model_digest(model.to_spec())
    job = planned(model, input_path, django_capture_on_commit_callbacks)
    run_shards(job, before_each=lambda index: other_weights(model) if index == 2 else None)
    after = model_digest(model.to_spec())
    job = merged(job, django_capture_on_commit_callbacks)

    assert before is not None and after is not None and before.digest != after.digest
    assert job.status == JobStatus.FAILED
    assert "ran on different weights" in job.error
    assert f"{before.digest} (2 shards on {socket.gethostname()})" in job.error
    assert f"{after.digest} (1 shards on {socket.gethostname()})" in job.error
    assert not store_for(job.output_uri).exists(job.output_uri), "nothing published"


def test_where_the_operator_allows_it_such_a_job_succeeds_its_manifest_marking_it(
    model: Model, input_path: Path, django_capture_on_commit_callbacks: Any, settings: Any
) -> None:
    settings.BATCHERY_ALLOW_MIXED_WEIGHTS = True
    job = planned(model, input_path, django_capture_on_commit_callbacks)
    run_shards(job, before_each=lambda index: other_weights(model) if index == 1 else None)
    job = merged(job, django_capture_on_commit_callbacks)

    assert job.status == JobStatus.SUCCEEDED, job.error
    assert job.provenance["mixed_weights"] is True
    assert [entry["shards"] for entry in job.provenance["weights"]] == [2, 1]


def test_a_job_pinned_to_weights_the_fleet_no_longer_has_is_refused_and_a_slot_holding_others_refuses_it(
    model: Model, input_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    elsewhere = "sha256:" + "0" * 64
    # No job of the model has run: the pin is taken as asked, and the slot, holding other weights, refuses.
    pinned = planned(model, input_path, django_capture_on_commit_callbacks, model_digest=elsewhere)
    with pytest.raises(OtherWeights, match=f"not {elsewhere} the job was pinned to"):
        execute_shard(shard_spec(pinned, pinned.shards.first()), worker="w1")  # type: ignore[arg-type]

    with pytest.raises(SubmissionError, match="must be 'sha256:' and 64 hex digits") as malformed:
        planned(model, input_path, django_capture_on_commit_callbacks, model_digest="sha256:abc")
    assert malformed.value.field == "model_digest"

    ran = planned(model, input_path, django_capture_on_commit_callbacks)
    run_shards(ran)
    ran = merged(ran, django_capture_on_commit_callbacks)
    digest = ran.provenance["model"]["weights_digest"]

    with pytest.raises(SubmissionError, match="the fleet no longer has them") as gone:
        planned(model, input_path, django_capture_on_commit_callbacks, model_digest=elsewhere)
    assert gone.value.field == "model_digest"
    again = planned(model, input_path, django_capture_on_commit_callbacks, model_digest=digest)
    run_shards(again)
    assert merged(again, django_capture_on_commit_callbacks).provenance["model"]["pinned_digest"] == digest


def test_the_same_sampled_job_with_a_seed_writes_the_same_bytes_with_other_shard_and_micro_batch_sizes(
    model: Model, input_path: Path, django_capture_on_commit_callbacks: Any
) -> None:
    outputs = []
    for shard_size, micro_batch_size in ((4, 3), (5, 16)):
        job = job_submit(
            tenant=TenantFactory(),
            request=JobRequest(
                model_name=model.name,
                input_uri=str(input_path),
                shard_size=shard_size,
                params={**PARAMS, "temperature": 1.0, "max_tokens": 6, "micro_batch_size": micro_batch_size},
            ),
        )
        with django_capture_on_commit_callbacks():
            job_plan(job_id=str(job.id))
        job.refresh_from_db()
        run_shards(job)
        job = merged(job, django_capture_on_commit_callbacks)
        assert job.status == JobStatus.SUCCEEDED, job.error
        outputs.append(store_for(job.output_uri).read_bytes(job.output_uri))

    assert outputs[0] == outputs[1]
    texts = [orjson.loads(line)["response"]["text"] for line in outputs[0].splitlines()]
    assert len(set(texts)) > RECORDS // 2, "sampled: the records' draws differ"
