"""Portal test helpers: people with passwords and roles, jobs made directly in the database, a tiny chat
model with a LoRA adapter of it, and for the browser tests a Chromium for the session, a page per test
and screenshots under test-artifacts/."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from portal.catalog.models import Model
from portal.jobs.models import FINAL_STATUSES, Job, JobEvent, JobStatus
from portal.tenancy.models import Membership, Tenant
from tests.factories import MembershipFactory, ModelFactory, TenantFactory
from tests.support.browser import CHROMIUM, browser_page, chromium, chromium_available
from tests.support.throttles import throttle_counts_clear
from tests.support.tiny_models import build_tiny_causal_lm, build_tiny_lora

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
PASSWORD = "correct horse battery staple"


@pytest.fixture(autouse=True)
def no_throttle_counts() -> None:
    """Failed sign-ins and keys of earlier tests (and runs) do not throttle this one."""
    throttle_counts_clear()


@pytest.fixture
def fast_passwords(settings: Any) -> None:
    """Hash test passwords cheaply: PBKDF2's cost buys nothing here."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def person(db: None, fast_passwords: None) -> Callable[..., User]:
    """Make a user with a password and a role in one or more tenants (created by name)."""

    def make(username: str, *tenants: str | Tenant, role: str = Membership.Role.MEMBER) -> User:
        user = User.objects.create_user(username=username, password=PASSWORD)
        for tenant in tenants:
            found = tenant if isinstance(tenant, Tenant) else TenantFactory(name=tenant)
            MembershipFactory(user=user, tenant=found, role=role)
        return user

    return make


def make_job(tenant: Tenant, model: Any, *, status: str = JobStatus.SUCCEEDED, **fields: Any) -> Job:
    """A job row as the pipeline leaves it, without running anything (no message is sent)."""
    job_id = uuid.uuid4()
    defaults: dict[str, Any] = {
        "input_uri": "file:///data/input.jsonl",
        "shard_size": 10,
        "total_records": 10,
        "output_uri": f"file:///nowhere/{job_id}/output.jsonl",
        "errors_uri": f"file:///nowhere/{job_id}/errors.jsonl",
    }
    if status in FINAL_STATUSES:
        defaults.update(shard_count=1, succeeded_records=10, finished_at=timezone.now())
    job = Job.objects.create(id=job_id, tenant=tenant, model=model, status=status, **{**defaults, **fields})
    for step in (JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING):
        JobEvent.objects.create(job=job, status=step)
        if step == status:
            break
    if status in FINAL_STATUSES:
        JobEvent.objects.create(job=job, status=status)
    return job


@dataclass(frozen=True)
class TinyLora:
    """A tiny GPT-2 and a LoRA adapter of it, both saved once for the session."""

    base: Path
    lora: Path


@pytest.fixture(scope="session")
def tiny_lora_files(tmp_path_factory: pytest.TempPathFactory) -> TinyLora:
    root = tmp_path_factory.mktemp("tiny-lora")
    base = build_tiny_causal_lm(root / "tiny-chat")
    return TinyLora(base=base, lora=build_tiny_lora(base, root / "lora", seed=3))


@pytest.fixture
def tiny_chat(db: None, tiny_lora_files: TinyLora) -> Model:
    """`tiny_lora_files`' GPT-2 registered as chat model ``tiny-chat`` on the transformers engine."""
    return ModelFactory(
        name="tiny-chat",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.CHAT,
        source=str(tiny_lora_files.base),
        is_default=False,
    )


# ---------------------------------------------------------------- browser tests


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One headless Chromium for the session; the browser tests skip where it is not installed."""
    if not chromium_available():
        pytest.skip(f"{CHROMIUM} is not installed (CI installs Debian's chromium package)")
    # Playwright's sync API keeps an event loop on this thread, which makes Django refuse ORM calls
    # from the test body; they are plain synchronous calls, so allow them while the browser lives.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with chromium() as launched:
            yield launched
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: Any, live_server: Any) -> Iterator[Any]:
    """A fresh page (its own cookies) against the live server."""
    with browser_page(browser, live_server.url) as fresh:
        yield fresh


def sign_in(page: Any, username: str, password: str = PASSWORD) -> None:
    """Sign in through the login form and land on the dashboard."""
    page.goto("/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert "/login/" not in page.url, page.content()


@pytest.fixture
def screenshot() -> Callable[[Any, str], Path]:
    """Save a full-page PNG of `page` as test-artifacts/screenshots/<name>.png."""

    def take(page: Any, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    return take
