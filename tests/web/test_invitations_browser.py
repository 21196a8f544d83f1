"""The invitation flow in a real browser: signed in, the invited person finds it and accepts it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from portal.tenancy.invitations import invitation_create
from portal.tenancy.models import Membership, Tenant
from tests.web.conftest import sign_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_an_invited_person_accepts_from_the_invitations_page(
    person: Callable[..., User], page: Any, screenshot: Callable[[Any, str], Any]
) -> None:
    person("alice", "acme")
    ann = person("ann", "beta", role=Membership.Role.ADMIN)
    invitation_create(
        tenant=Tenant.objects.get(name="beta"),
        username="alice",
        role=Membership.Role.VIEWER,
        actor_role=Membership.Role.ADMIN,
        actor=ann,
    )
    sign_in(page, "alice")
    expect(page.locator(".tenant-name")).to_have_text("acme")

    page.click("text=Invitations")
    row = page.locator("#invitations tbody tr")
    expect(row).to_contain_text("beta")
    expect(row).to_contain_text("viewer")
    screenshot(page, "invitations")
    with page.expect_navigation():
        row.locator("button", has_text="Accept").click()

    expect(page.locator(".flash")).to_contain_text("You joined beta as viewer")
    expect(page.locator("#tenant-select")).to_have_value("beta")
    assert Membership.objects.filter(user__username="alice", tenant__name="beta", role="viewer").exists()
