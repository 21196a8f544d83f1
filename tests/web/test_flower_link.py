"""The fleet pages link to Flower for staff only: Flower shows every tenant's tasks and controls workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from portal.tenancy.models import Membership, Tenant

pytestmark = pytest.mark.django_db

FLOWER_URL = "https://flower.batchery.test:5555/"


@pytest.fixture(autouse=True)
def flower_url(settings: Any) -> None:
    settings.BATCHERY_FLOWER_URL = FLOWER_URL


def _client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_fleet_page_links_to_flower_for_staff(person: Callable[..., User], acme: Tenant) -> None:
    staff = person("sam", acme, role=Membership.Role.ADMIN)
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    html = _client(staff).get("/fleet/").content.decode()
    assert f'id="flower-link" href="{FLOWER_URL}"' in html


def test_the_fleet_page_hides_flower_from_a_member_who_is_not_staff(person: Callable[..., User], acme: Tenant) -> None:
    # Even a tenant's admin: Flower is the operators' tool, across every tenant.
    for user in (person("alice", acme), person("ada", acme, role=Membership.Role.ADMIN)):
        page = _client(user).get("/fleet/")
        assert page.status_code == 200
        assert "flower-link" not in page.content.decode() and FLOWER_URL not in page.content.decode()


def test_the_polled_part_of_the_fleet_page_does_not_repeat_the_link(person: Callable[..., User], acme: Tenant) -> None:
    staff = person("sam", acme)
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    assert FLOWER_URL not in _client(staff).get("/fleet/live/").content.decode()


def test_the_admins_fleet_page_links_to_flower(admin_client: Client) -> None:
    page = admin_client.get("/admin/ops/fleetslot/")
    assert page.status_code == 200
    assert f'id="flower-link" href="{FLOWER_URL}"' in page.content.decode()
