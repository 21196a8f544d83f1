"""Fixtures of the task-side tests: a moto S3 server and a bucket on it, as a deployment reaches S3."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from tasks.shared.storage import S3Store, registry
from tasks.shared.storage.s3 import MIN_PART_BYTES
from tests.support.moto_server import running_moto_server


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    with running_moto_server() as url:
        yield url


@pytest.fixture
def s3_env(moto_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Credentials and endpoint as a deployment would set them, isolated from the machine's AWS setup;
    the registry's store is built afresh from them, as it would be in a fresh process."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("BATCHERY_S3_PART_BYTES", str(MIN_PART_BYTES))
    monkeypatch.setattr(registry, "_S3", S3Store())
    return moto_url


@pytest.fixture
def bucket(s3_env: str) -> str:
    """A new bucket on the test's S3 server."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return name
