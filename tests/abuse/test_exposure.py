"""Attacks on what the platform exposes: Flower's API and controls, the portal's `/metrics`, and the
platform's storage root in what a tenant reads back about its own job."""

from __future__ import annotations

import io
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from portal.devstack.embedded import free_port
from tests.abuse.conftest import ABUSE_ENV
from tests.support.abuse import MODEL, AbuseResult, AbuseStack
from tests.support.workers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.abuse]

METRICS_TOKEN = ABUSE_ENV["BATCHERY_METRICS_TOKEN"]


def _without_flower_settings(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if not name.startswith("FLOWER_")}


@pytest.fixture(scope="module")
def flower(abuse_stack: AbuseStack) -> Iterator[tuple[str, str]]:
    """Flower on the stack's broker, started as the product starts it; its base URL and `user:password`."""
    login = f"ops:{secrets.token_urlsafe(24)}"
    port = free_port()
    env = {**_without_flower_settings(abuse_stack.env), "FLOWER_BASIC_AUTH": login}
    log_path = abuse_stack.log_dir / "flower.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "portal.ops.flower", "--address=127.0.0.1", f"--port={port}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            try:
                httpx.get(f"{base_url}/healthcheck", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
                time.sleep(0.5)
        yield base_url, login
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 15)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()


def test_flower_answers_only_its_login(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], flower: tuple[str, str]
) -> None:
    base_url, login = flower
    user, password = login.split(":", 1)

    def attack() -> str:
        with httpx.Client(base_url=base_url, timeout=30) as client:
            for path in ("/api/workers", "/api/tasks"):
                anonymous = client.get(path)
                assert anonymous.status_code == 401, (path, anonymous.text[:300])
                guessed = client.get(path, auth=(user, "guess"))
                assert guessed.status_code == 401, (path, guessed.text[:300])
                assert client.get(path, auth=("admin", password)).status_code == 401, path
            revoke = client.post(f"/api/task/revoke/{uuid.uuid4()}")
            assert revoke.status_code == 401, revoke.text[:300]
            workers = client.get("/api/workers", auth=(user, password))
            assert workers.status_code == 200, workers.text[:300]
        return "API anonymous or wrong login: 401; anonymous revoke: 401; the login: 200"

    abuse_report("Flower without its login", attack)


def test_flower_will_not_start_without_credentials(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    def attack() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "portal.ops.flower", "--address=127.0.0.1", f"--port={free_port()}"],
            cwd=REPO, env=_without_flower_settings(abuse_stack.env), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
        assert "FLOWER_BASIC_AUTH" in done.stderr, done.stderr[-2000:]
        return "exit 2 naming FLOWER_BASIC_AUTH"

    abuse_report("starting Flower with no credentials", attack)


def test_metrics_answer_only_the_token(abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]) -> None:
    def attack() -> str:
        with httpx.Client(base_url=abuse_stack.base_url, timeout=30) as client:
            anonymous = client.get("/metrics")
            assert anonymous.status_code == 401 and "batchery_" not in anonymous.text, anonymous.text[:300]
            wrong = client.get("/metrics", headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 401 and "batchery_" not in wrong.text, wrong.text[:300]
            right = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
            assert right.status_code == 200 and "batchery_" in right.text, right.text[:300]
        return "no token or a wrong one: 401, no metric; the token: 200"

    abuse_report("/metrics without the token", attack)


def test_a_tenant_never_sees_the_storage_root(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    owner = abuse_stack.tenant("uploader")
    other = abuse_stack.tenant("upload-borrower")
    roots = (str(abuse_stack.storage_root), abuse_stack.storage_root.as_uri())
    body = b"".join(orjson.dumps({"custom_id": f"u{n}", "input": f"upload {n}"}) + b"\n" for n in range(3))

    def attack() -> str:
        with abuse_stack.api(owner) as client:
            created = client.post(
                "/api/v1/jobs/", data={"model": MODEL}, files={"file": ("mine.jsonl", io.BytesIO(body))}
            )
            assert created.status_code == 201, created.text
            job = client.get(f"/api/v1/jobs/{created.json()['id']}/")
            listing = client.get("/api/v1/jobs/")
        input_uri = job.json()["input_uri"]
        assert input_uri.startswith("upload://"), input_uri
        for answer in (created, job, listing):
            assert answer.status_code in (200, 201), answer.text
            assert not any(root in answer.text for root in roots), answer.text
        stored = next(abuse_stack.storage_root.glob(f"uploads/*/{input_uri.removeprefix('upload://')}"))
        with abuse_stack.api(other) as client:
            borrowed = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": input_uri})
            assert borrowed.status_code == 400, borrowed.text
            direct = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": stored.as_uri()})
            assert direct.status_code == 400, direct.text
        assert not any(root in borrowed.text for root in roots), borrowed.text
        return "job and list show upload://, no storage root; another tenant naming it (upload:// or file://): 400"

    abuse_report("the storage root in a tenant's view", attack)


def test_a_refused_input_does_not_show_the_storage_root(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]
) -> None:
    prober = abuse_stack.tenant("root-prober")
    roots = (str(abuse_stack.storage_root), abuse_stack.storage_root.as_uri())

    def attack() -> str:
        with abuse_stack.api(prober) as client:
            refused = client.post("/api/v1/jobs/", json={"model": MODEL, "input_uri": "file:///etc/passwd"})
        assert refused.status_code == 400, refused.text
        assert not any(root in refused.text for root in roots), refused.text
        return "file:///etc/passwd: 400, no storage root in it"

    abuse_report("a refused input's message", attack)
