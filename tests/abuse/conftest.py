"""Fixtures of the abuse suite: one live stack for the suite, the victim tenant, and the report table.

`make abuse` runs the suite at full size (ABUSE_SCALE=full) and prints the table; `make test` runs
it at a smaller size where CI=true. The stack shares the test database, so its tests use no
database fixture of their own (a transactional test's flush would empty the stack's tenants); they
reach the database through `abuse_stack.db()`. The suite empties the database when it ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import wait_consuming
from tests.support.abuse import VICTIM_DEADLINE_S, AbuseResult, AbuseStack, TenantAccess, in_background
from tests.support.workers import database_url

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
FULL = os.environ.get("ABUSE_SCALE") == "full"
RESULTS: list[AbuseResult] = []

ABUSE_ENV = {
    "DJANGO_SETTINGS_MODULE": "portal.settings",
    "BATCHERY_RECONCILE_INTERVAL_S": "2",
    # Receivers of the webhook attacks listen on 127.0.0.1; a trickling one is cut sooner than by default.
    "BATCHERY_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    "BATCHERY_WEBHOOK_ATTEMPT_DEADLINE_S": "5",
    "BATCHERY_WEBHOOK_RETRY_DELAYS_S": "1,1",
    "BATCHERY_WEBHOOK_MAX_ENDPOINTS_PER_TENANT": "5",
    # Batch files past this are validated by the validation worker, not in the request.
    "BATCHERY_BATCH_SYNC_VALIDATION_BYTES": "1024",
    # Low enough for an attack to cross it with a small input.
    "BATCHERY_MAX_SHARDS_PER_JOB": "100",
    # Guessed keys: the attack crosses it; the tests of keys that must answer 401 stay under it.
    "BATCHERY_API_KEY_FAILURE_LIMIT": "50",
    # Every shipped deployment sets one; the exposure attacks ask /metrics without it.
    "BATCHERY_METRICS_TOKEN": "abuse-metrics-token",
}


def scale(small: int, full: int) -> int:
    return full if FULL else small


class _StackWithDb(AbuseStack):
    blocker: Any = None

    def db(self) -> AbstractContextManager[None]:
        return self.blocker.unblock()

    def tenant(self, name: str, *, role: str = "owner", **quota: Any) -> TenantAccess:
        with self.db():
            return super().tenant(name, role=role, **quota)

    def member(self, tenant_name: str, username: str, *, role: str = "member") -> TenantAccess:
        with self.db():
            return super().member(tenant_name, username, role=role)


@pytest.fixture(scope="package")
def abuse_database(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """The test database, made here when no test of this run asked pytest-django for one (its
    tests use none: see the module's docstring); emptied when the suite ends."""
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        made = None
        if not connection.settings_dict["NAME"].startswith("test_"):
            made = setup_databases(verbosity=0, interactive=False, aliases={"default"})
        try:
            yield
        finally:
            call_command("flush", interactive=False, verbosity=0)
            if made is not None:
                teardown_databases(made, verbosity=0)


@pytest.fixture(scope="package")
def abuse_stack(
    abuse_database: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AbuseStack]:
    from django.db import connection

    from tests.factories import ModelFactory

    data_dir = tmp_path_factory.mktemp("abuse")
    env = {**os.environ, **ABUSE_ENV}
    env["DATABASE_URL"] = database_url(connection.settings_dict)
    env["BATCHERY_STORAGE_URL"] = (data_dir / "storage").as_uri()
    env["TMPDIR"] = str(data_dir / "tmp")
    (data_dir / "tmp").mkdir()
    stack = _StackWithDb(env=env, data_dir=data_dir, log_dir=ARTIFACTS / "abuse-logs")
    stack.blocker = django_db_blocker
    with django_db_blocker.unblock():
        ModelFactory()
    stack.start_redis()
    try:
        stack.start_control()
        stack.start_shard_worker()
        stack.start_lanes()
        stack.start_portal()
        wait_consuming(stack, timeout_s=120)
        victim = stack.tenant("victim")
        stack.victim_job_seconds(victim)  # warms every path the victim's job takes
        stack.baseline_s = min(stack.victim_job_seconds(victim) for _ in range(2))
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def victim(abuse_stack: AbuseStack) -> TenantAccess:
    return abuse_stack.tenant("victim")


@pytest.fixture
def abuse_report(abuse_stack: AbuseStack) -> Callable[..., AbuseResult]:
    """`abuse_report(attack_name, attack, lead_s=0.5)`: run `attack` (a function that makes its
    requests, asserts what the platform must answer, and returns that answer in a few words) in the
    background; `lead_s` into it, the victim submits its three-record job and times it to its end. Adds
    the row to the table and asserts that the victim's job ended within the issue's ten seconds and
    that the portal answered no request with a 5xx meanwhile."""

    def report(attack_name: str, attack: Callable[[], str], lead_s: float = 0.5) -> AbuseResult:
        before = abuse_stack.bytes_on_disk()
        _, log_at = abuse_stack.server_errors()
        with in_background(attack) as answer_of:
            time.sleep(lead_s)
            victim_s = abuse_stack.victim_job_seconds(abuse_stack.tenant("victim"))
            answer = answer_of()
        result = AbuseResult(
            attack=attack_name,
            answer=answer,
            victim_s=round(victim_s, 2),
            delay_s=round(max(0.0, victim_s - abuse_stack.baseline_s), 2),
            bytes_written=abuse_stack.bytes_on_disk() - before,
        )
        RESULTS.append(result)
        errors, _ = abuse_stack.server_errors(log_at)
        assert not errors, f"{attack_name}: the portal answered 5xx: {errors[:10]}"
        assert victim_s < VICTIM_DEADLINE_S, f"{attack_name}: the victim's job took {victim_s:.1f} s"
        return result

    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    header = ["attack", "answer", "victim's job (s)", "delay (s)", "bytes written"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [f"| {r.attack} | {r.answer} | {r.victim_s} | {r.delay_s} | {r.bytes_written:,} |" for r in RESULTS]
    table = "\n".join(lines)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "abuse.md").write_text(table + "\n")
    terminalreporter.write_sep("=", "abuse")
    terminalreporter.write_line(table)
