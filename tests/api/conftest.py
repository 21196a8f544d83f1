"""API test helpers: a key per (tenant, role), clients that send it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from portal.catalog.models import Model
from portal.tenancy.apikeys import apikey_create
from portal.tenancy.models import Membership, Tenant
from tests.factories import MembershipFactory, ModelFactory, TenantFactory, UserFactory
from tests.support.throttles import throttle_counts_clear
from tests.support.tiny_models import build_tiny_causal_lm


@pytest.fixture(autouse=True)
def no_throttle_counts() -> None:
    """Failed sign-ins and keys of earlier tests (and runs) do not throttle this one."""
    throttle_counts_clear()


@dataclass
class Caller:
    tenant: Tenant
    user: Any
    key: str
    client: APIClient


def make_caller(tenant: Tenant, role: str = Membership.Role.MEMBER, username: str | None = None) -> Caller:
    user = UserFactory(username=username or f"{tenant.name}-{role}")
    MembershipFactory(user=user, tenant=tenant, role=role)
    _, key = apikey_create(tenant=tenant, user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return Caller(tenant=tenant, user=user, key=key, client=client)


@pytest.fixture
def caller(db: None) -> Callable[..., Caller]:
    """Make a caller: a user with a role in a tenant (created by name), and a key for them."""

    def make(tenant: str | Tenant = "acme", role: str = Membership.Role.MEMBER, username: str | None = None) -> Caller:
        found = tenant if isinstance(tenant, Tenant) else TenantFactory(name=tenant)
        return make_caller(found, role, username)

    return make


@pytest.fixture
def tiny_chat(db: None, tmp_path: Path) -> Model:
    """A tiny GPT-2 saved by the test, registered as chat model ``tiny-chat`` on the transformers engine."""
    return ModelFactory(
        name="tiny-chat",
        engine=Model.Engine.TRANSFORMERS,
        task=Model.Task.CHAT,
        source=str(build_tiny_causal_lm(tmp_path / "tiny-chat")),
        is_default=False,
    )
