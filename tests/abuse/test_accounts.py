"""Attacks on accounts: guessing keys and passwords, keys that outlive their people, attaching
someone to a hostile tenant. Operators' own acts (deactivating a user, adding a member back) run as
they would, in a `manage.py` process of the stack, so the stack's own caches hear of them."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.abuse.conftest import scale
from tests.support.abuse import AbuseResult, AbuseStack, TenantAccess
from tests.support.throttles import throttle_counts_clear

pytestmark = [pytest.mark.slow, pytest.mark.abuse]


def _operator(stack: AbuseStack, code: str) -> None:
    stack.manage("shell", "-c", code)


def _statuses(stack: AbuseStack, key: str, times: int, path: str = "/api/v1/jobs/") -> list[int]:
    """`times` requests with `key`, each on a new connection so that every portal worker answers some."""

    def one(_: int) -> int:
        return httpx.get(f"{stack.base_url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(times)))


def test_keys_end_with_their_people(abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]) -> None:
    owner = abuse_stack.tenant("leavers")
    leaver = abuse_stack.member("leavers", "leaver")
    staff = abuse_stack.member("leavers", "staff-leaver")
    _operator(
        abuse_stack,
        f"from django.contrib.auth import get_user_model as u; u().objects.filter(username='{staff.username}')"
        ".update(is_staff=True)",
    )

    def attack() -> str:
        assert set(_statuses(abuse_stack, leaver.api_key, 8) + _statuses(abuse_stack, staff.api_key, 8)) == {200}
        _operator(
            abuse_stack,
            "from django.contrib.auth import get_user_model as u; user = u().objects.get(username="
            f"'{staff.username}'); user.is_active = False; user.save()",
        )
        deactivated = _statuses(abuse_stack, staff.api_key, 8)
        assert set(deactivated) == {401}, deactivated
        with abuse_stack.api(owner) as client:
            members = client.get("/api/v1/members/").json()
            rows = members["results"] if isinstance(members, dict) else members
            member = next(row for row in rows if row["username"] == leaver.username)
            removed = client.delete(f"/api/v1/members/{member['id']}/")
            assert removed.status_code == 204, removed.text
        gone = _statuses(abuse_stack, leaver.api_key, 8)
        _operator(
            abuse_stack,
            "from django.contrib.auth import get_user_model as u; from portal.tenancy.models import Membership as M, "
            f"Tenant as T; M.objects.create(user=u().objects.get(username='{leaver.username}'), "
            "tenant=T.objects.get(name='leavers'), role='member')",
        )
        back = _statuses(abuse_stack, leaver.api_key, 8)
        assert set(gone) == {401} and set(back) == {401}, (gone, back)
        return "deactivated staff key: 401 at once; removed member's key: 401, still 401 once added back"

    abuse_report("keys of people who left", attack)


def test_a_tenant_admin_cannot_attach_another_tenants_user(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], victim: TenantAccess
) -> None:
    evil = abuse_stack.tenant("evil")

    def attack() -> str:
        with abuse_stack.api(evil) as client:
            attached = client.post("/api/v1/members/", json={"username": victim.username, "role": "admin"})
            assert attached.status_code == 405 and attached.json()["error"]["code"] == "invitation_required"
            invited = client.post("/api/v1/invitations/", json={"username": victim.username, "role": "admin"})
            assert invited.status_code == 201 and invited.json()["status"] == "pending", invited.text
        with abuse_stack.db():
            from portal.tenancy.models import Membership

            assert not Membership.objects.filter(user__username=victim.username, tenant__name="evil").exists()
        return "attach: 405 invitation_required; invitation pending, no membership"

    abuse_report("attaching another tenant's user", attack)


def test_guessed_keys_are_throttled_while_good_keys_keep_working(
    abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult], victim: TenantAccess
) -> None:
    guesses = scale(60, 400)

    def attack() -> str:
        bad = [
            _statuses(abuse_stack, f"bk_{secrets.token_hex(4)}_{secrets.token_urlsafe(8)}", 1)[0]
            for _ in range(guesses)
        ]
        assert set(bad) <= {401, 429} and bad[-1] == 429, bad
        throttled = httpx.get(f"{abuse_stack.base_url}/v1/files", headers={"Authorization": "Bearer nonsense"})
        assert throttled.status_code == 429 and 0 < int(throttled.headers["Retry-After"]) <= 300
        assert throttled.json()["error"]["type"] == "rate_limit_error"
        good = _statuses(abuse_stack, victim.api_key, 8) + _statuses(abuse_stack, victim.api_key, 8, "/v1/batches")
        assert set(good) == {200}, good
        return f"{guesses} guessed keys: {bad.count(401)} x 401 then 429 + Retry-After; good keys 200"

    try:
        abuse_report("guessing API keys from one address", attack)
    finally:
        # Lifted as an operator would: the attacks after this one come from the same address.
        throttle_counts_clear(abuse_stack.broker_url)


def test_password_guessing_is_throttled(abuse_stack: AbuseStack, abuse_report: Callable[..., AbuseResult]) -> None:
    target = abuse_stack.tenant("signin-target")
    attempts = scale(12, 40)

    def attack() -> str:
        statuses = []
        with httpx.Client(base_url=abuse_stack.base_url, timeout=30) as browser:
            for _ in range(attempts):
                form = browser.get("/login/").text
                token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
                assert token, form[:500]
                answer = browser.post(
                    "/login/",
                    data={"username": target.username, "password": "wrong", "csrfmiddlewaretoken": token.group(1)},
                )
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    assert int(answer.headers["Retry-After"]) > 0
        assert statuses[0] == 200 and statuses[-1] == 429, statuses
        return f"{attempts} wrong passwords: {statuses.count(200)} x 200, then 429 + Retry-After"

    try:
        abuse_report("guessing a password", attack)
    finally:
        throttle_counts_clear(abuse_stack.broker_url)
