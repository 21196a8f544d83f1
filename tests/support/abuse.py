"""The abuse harness: a live stack that hostile tenants attack while another tenant's small job runs.

The stack is the chaos harness's (its own embedded Redis, a control worker running beat, a warm
slot of the bundled model) plus the portal under gunicorn and a worker for each lane of its own
(`LANES`). Tenants and their API keys are made in the test database the stack shares. The victim
submits a three-record job through the REST API and times it to its end; an attack reports what the
platform answered, how much longer the victim took than it did before any attack, and the bytes the
stack's storage and temporary files grew by.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from portal.devstack.embedded import free_port
from tests.support.chaos import ChaosStack
from tests.support.workers import REPO, start_worker

VICTIM_RECORDS = 3
VICTIM_DEADLINE_S = 10.0
"""The issue's promise: another tenant's three-record job ends within this of its submission."""
MODEL = "all-MiniLM-L6-v2"

LANES: tuple[tuple[str, int], ...] = (("webhooks", 4), ("validation", 1))
"""Queues other than control and the slot's that get a worker of their own, and its concurrency (the
webhooks worker's above a tenant's in-flight cap, so that one tenant cannot take all its processes)."""


@dataclass(frozen=True)
class TenantAccess:
    name: str
    username: str
    password: str
    api_key: str


@dataclass(frozen=True)
class AbuseResult:
    attack: str
    answer: str
    """What the platform answered, in a few words (statuses, the error's gist)."""
    victim_s: float
    """How long the victim's job took from its submission to its end, during the attack."""
    delay_s: float
    """`victim_s` beyond what it took before any attack."""
    bytes_written: int


@dataclass
class AbuseStack(ChaosStack):
    portal: subprocess.Popen[bytes] | None = None
    base_url: str = ""
    baseline_s: float = 0.0
    tenants: dict[str, TenantAccess] = field(default_factory=dict)

    @property
    def storage_root(self) -> Path:
        return self.data_dir / "storage"

    @property
    def tmp_root(self) -> Path:
        return self.data_dir / "tmp"

    def start_lanes(self) -> None:
        for queue, concurrency in LANES:
            self.workers[queue] = start_worker(
                queue, queue, env=self.env, log_dir=self.log_dir, concurrency=concurrency
            )

    def start_portal(self, workers: int = 2) -> None:
        port = free_port()
        log = (self.log_dir / "portal.log").open("ab")
        self.portal = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "portal.wsgi", "--config", "python:portal.gunicorn_conf",
             "--bind", f"127.0.0.1:{port}", "--workers", str(workers), "--timeout", "60",
             "--access-logfile", str(self.access_log), "--access-logformat", "%(s)s %(r)s"],
            cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.portal.poll() is not None:
                raise RuntimeError(f"the portal exited early:\n{self.portal_log()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the portal did not answer within 60 s:\n{self.portal_log()}")

    @property
    def access_log(self) -> Path:
        return self.log_dir / "portal-access.log"

    def server_errors(self, since: int = 0) -> tuple[list[str], int]:
        """The requests the portal answered with a 5xx in its access log past byte `since`, and where
        the log ends now (each line: the status, then the request line)."""
        data = self.access_log.read_bytes()[since:] if self.access_log.exists() else b""
        lines = data.decode(errors="replace").splitlines()
        return [line for line in lines if line[:1] == "5"], since + len(data)

    @contextmanager
    def paused(self, worker: str) -> Iterator[None]:
        """The worker and its pool stopped (SIGSTOP) while the block runs, as a busy or slow one would be."""
        main = psutil.Process(self.workers[worker].process.pid)
        processes = [main, *main.children(recursive=True)]
        for process in processes:
            process.suspend()
        try:
            yield
        finally:
            for process in processes:
                process.resume()

    def portal_log(self) -> str:
        path = self.log_dir / "portal.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-60:]) if path.exists() else ""

    def stop(self) -> None:
        if self.portal is not None and self.portal.poll() is None:
            self.portal.terminate()
            try:
                self.portal.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.portal.pid, 9)
                self.portal.wait()
        super().stop()

    def tenant(self, name: str, *, role: str = "owner", **quota: Any) -> TenantAccess:
        """A tenant with one user of `role` and an API key; `quota` sets fields of its quota row."""
        if name in self.tenants and not quota:
            return self.tenants[name]
        from portal.tenancy.models import Quota, Tenant

        tenant, _ = Tenant.objects.get_or_create(name=name)
        Quota.objects.update_or_create(tenant=tenant, defaults=quota)
        self.tenants[name] = self.member(name, f"{name}-{role}", role=role)
        return self.tenants[name]

    def member(self, tenant_name: str, username: str, *, role: str = "member") -> TenantAccess:
        """A user of `role` in the tenant, with a password and an API key for that tenant."""
        from django.contrib.auth import get_user_model

        from portal.tenancy.apikeys import apikey_create
        from portal.tenancy.models import Membership, Tenant

        tenant = Tenant.objects.get(name=tenant_name)
        password = f"pw-{username}-{os.urandom(6).hex()}"
        user, _ = get_user_model().objects.get_or_create(username=username)
        user.set_password(password)
        user.save()
        Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": role})
        _, key = apikey_create(tenant=tenant, user=user, name="abuse")
        return TenantAccess(name=tenant_name, username=username, password=password, api_key=key)

    def api(self, access: TenantAccess, timeout_s: float = 30) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {access.api_key}"}, timeout=timeout_s
        )

    def bytes_on_disk(self) -> int:
        """Bytes under the stack's storage and its processes' temporary directory."""
        total = 0
        for root in (self.storage_root, self.tmp_root):
            for dirpath, _, files in os.walk(root):
                for name in files:
                    try:
                        total += os.lstat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:
                        continue
        return total

    def victim_job_seconds(self, access: TenantAccess, timeout_s: float = 60) -> float:
        """Submit a three-record job for `access` through the REST API; seconds until it succeeded."""
        body = b"".join(orjson.dumps({"custom_id": f"v{n}", "input": f"victim {n}"}) + b"\n" for n in range(3))
        started = time.monotonic()
        with self.api(access) as client:
            created = client.post(
                "/api/v1/jobs/", data={"model": MODEL}, files={"file": ("victim.jsonl", io.BytesIO(body))}
            )
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            while time.monotonic() - started < timeout_s:
                status = client.get(f"/api/v1/jobs/{job_id}/").json()["status"]
                if status == "succeeded":
                    return time.monotonic() - started
                assert status in {"queued", "planning", "running", "merging"}, status
                time.sleep(0.1)
        raise TimeoutError(f"the victim's job {job_id} did not end within {timeout_s} s:\n{self.logs()}")


@contextmanager
def in_background(attack: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
    """Run `attack` in a thread while the block runs; yields a function that joins it and returns its result
    (or raises what it raised)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = attack()
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout_s: float = 120) -> Any:
        thread.join(timeout_s)
        assert not thread.is_alive(), "the attack did not end"
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    yield result
    thread.join(120)


ENDED = ("succeeded", "partially_succeeded", "failed", "cancelled", "expired")


def job_ended(stack: AbuseStack, access: TenantAccess, job_id: str, timeout_s: float = 90) -> dict[str, Any]:
    """The tenant's job as the API shows it once it has ended (waited for up to `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    with stack.api(access) as client:
        while True:
            job = client.get(f"/api/v1/jobs/{job_id}/").json()
            if job["status"] in ENDED:
                return dict(job)
            assert time.monotonic() < deadline, job
            time.sleep(0.3)
