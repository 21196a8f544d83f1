"""Flower: the command line and its auth rules, `up`'s Flower behind a generated password, and the entry point's 401."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from portal.devstack.embedded import free_port
from portal.ops.flower import FlowerConfigError, flower_launch, generated_credentials
from tests.ops.conftest import UpProcess, stop_process_group

REPO = Path(__file__).resolve().parents[2]
SECRET = "user:secret"


@pytest.fixture
def no_flower_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leave the machine's own Flower settings out of the builder's tests."""
    for name in list(os.environ):
        if name.startswith("FLOWER_"):
            monkeypatch.delenv(name)


# ---------------------------------------------------------------- the command line


def test_credentials_from_the_environment_reach_flower_in_its_environment_not_its_command_line(
    no_flower_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWER_BASIC_AUTH", " ops:pa55 , oncall:w0rd ")
    launch = flower_launch(address="0.0.0.0", port=5555, python="/venv/bin/python")
    assert launch.command == (
        "/venv/bin/python", "-m", "celery", "--app", "tasks.app", "flower", "--address=0.0.0.0", "--port=5555",
    )  # fmt: skip
    assert launch.env["FLOWER_BASIC_AUTH"] == "ops:pa55,oncall:w0rd"
    assert "FLOWER_UNAUTHENTICATED_API" not in launch.env
    assert not any("pa55" in part for part in launch.command)


def test_credentials_from_a_file_are_resolved_for_flower_which_does_not_read_files(
    no_flower_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret = tmp_path / "flower_auth"
    secret.write_text("ops:from-a-file\n")
    monkeypatch.setenv("FLOWER_BASIC_AUTH_FILE", str(secret))
    # The file wins over the variable, as for every NAME_FILE secret (tasks.shared.env.env_str).
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "ops:stale")
    launch = flower_launch(address="10.1.2.3", port=5556)
    assert launch.env["FLOWER_BASIC_AUTH"] == "ops:from-a-file"
    assert "FLOWER_BASIC_AUTH_FILE" not in launch.env
    assert not any("from-a-file" in part for part in launch.command)


@pytest.mark.parametrize(
    "address", ["0.0.0.0", "", "10.0.0.5", "::", "flower.example.com", "127.0.0.1", "::1", "localhost"]
)
def test_any_address_without_auth_is_refused_naming_the_variables(no_flower_env: None, address: str) -> None:
    with pytest.raises(FlowerConfigError, match="FLOWER_BASIC_AUTH or FLOWER_BASIC_AUTH_FILE"):
        flower_launch(address=address, port=5555)


def test_flowers_unauthenticated_api_mode_is_never_handed_on(
    no_flower_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOWER_BASIC_AUTH", SECRET)
    launch = flower_launch(address="127.0.0.1", port=5555, environ={"FLOWER_UNAUTHENTICATED_API": "true"})
    assert launch.env == {"FLOWER_BASIC_AUTH": SECRET}
    assert not any("read_only" in part for part in launch.command)


def test_generated_credentials_are_strong_and_never_hold_flowers_separators() -> None:
    pairs = {generated_credentials() for _ in range(20)}
    assert len(pairs) == 20
    for user, password in pairs:
        assert user and len(password) >= 32
        assert not {",", ":"} & set(user + password)


@pytest.mark.parametrize("value", ["justauser", ":nopassword", "nouser:", "ok:fine,broken"])
def test_a_malformed_credential_is_refused_without_showing_it(
    no_flower_env: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FLOWER_BASIC_AUTH", value)
    with pytest.raises(FlowerConfigError, match="is not user:password") as refused:
        flower_launch(address="127.0.0.1", port=5555)
    assert value.split(",")[-1] not in str(refused.value)


def test_a_port_out_of_range_is_refused(no_flower_env: None) -> None:
    with pytest.raises(FlowerConfigError, match="between 1 and 65535"):
        flower_launch(address="127.0.0.1", port=0)


@pytest.mark.parametrize("address", ["0.0.0.0", "127.0.0.1"])
def test_the_entry_point_refuses_any_address_without_auth_before_starting_flower(address: str) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("FLOWER_")}
    env["FLOWER_ADDRESS"] = address
    # Even when asked for Flower's anonymous API mode.
    env["FLOWER_UNAUTHENTICATED_API"] = "true"
    done = subprocess.run(
        [sys.executable, "-m", "portal.ops.flower"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "FLOWER_BASIC_AUTH" in done.stderr and address in done.stderr


# ---------------------------------------------------------------- real Flower processes


def _get(url: str, *, auth: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _listening_addresses(port: int) -> set[str]:
    return {
        conn.laddr.ip
        for conn in psutil.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
    }


def _printed_login(log_path: Path, up: subprocess.Popen[bytes], deadline: float) -> str:
    """The `user:password` that `up` printed for its generated Flower login."""
    while time.monotonic() < deadline:
        assert up.poll() is None, log_path.read_text()[-3000:]
        found = re.search(r"Flower login \(generated for this run\): user (\S+), password (\S+)", log_path.read_text())
        if found:
            return f"{found[1]}:{found[2]}"
        time.sleep(1)
    raise AssertionError(log_path.read_text()[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_up_serves_flower_on_loopback_behind_a_generated_password_listing_the_workers(
    up_without_services: UpProcess,
) -> None:
    up, flower_port, log_path = (
        up_without_services.process,
        up_without_services.flower_port,
        up_without_services.log_path,
    )
    deadline = time.monotonic() + 180
    login = _printed_login(log_path, up, deadline)
    # Printed once, and in no process's command line (only in Flower's own environment).
    assert log_path.read_text().count(login.split(":")[1]) == 1
    for process in psutil.Process(up.pid).children(recursive=True):
        assert not any(login.split(":")[1] in part for part in process.cmdline())
    workers: dict[str, Any] = {}
    while time.monotonic() < deadline:
        assert up.poll() is None, log_path.read_text()[-3000:]
        try:
            # refresh=1: Flower inspects the workers now; it learnt none at its start, before they ran.
            status, body = _get(f"http://127.0.0.1:{flower_port}/api/workers?refresh=1", auth=login)
        except OSError:
            time.sleep(1)
            continue
        assert status in {200, 503}, body[:500]
        if status == 200:
            workers = json.loads(body)
            names = {name.split("@")[0] for name in workers}
            if {"control", "slot0-cpu"} <= names:
                break
        time.sleep(1)
    names = {name.split("@")[0] for name in workers}
    assert {"control", "slot0-cpu"} <= names, (sorted(workers), log_path.read_text()[-3000:])
    assert _listening_addresses(flower_port) == {"127.0.0.1"}
    # Anyone on the machine without the password reads nothing and controls nothing.
    for path in ("/api/workers", "/api/tasks", "/workers"):
        assert _get(f"http://127.0.0.1:{flower_port}{path}")[0] == 401, path
        assert _get(f"http://127.0.0.1:{flower_port}{path}", auth="batchery:guess")[0] == 401, path
    assert _get(f"http://127.0.0.1:{flower_port}/api/tasks", auth=login)[0] == 200
    control = next(name for name in workers if name.startswith("control@"))
    shutdown = _get(f"http://127.0.0.1:{flower_port}/api/worker/shutdown/{control}", method="POST")
    assert shutdown[0] == 401, shutdown
    assert up.poll() is None, log_path.read_text()[-3000:]
    assert re.search(rf"Flower http://127\.0\.0\.1:{flower_port}/", log_path.read_text())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_with_basic_auth_flowers_api_refuses_an_unauthenticated_request(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("FLOWER_")}
    env["FLOWER_BASIC_AUTH"] = SECRET
    port = free_port()
    log_path = tmp_path / "flower.log"
    with log_path.open("wb") as log:
        flower = subprocess.Popen(
            [sys.executable, "-m", "portal.ops.flower", "--address=127.0.0.1", f"--port={port}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert flower.poll() is None, log_path.read_text()[-3000:]
            try:
                unauthenticated, _ = _get(f"http://127.0.0.1:{port}/api/workers")
                break
            except OSError:
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
        assert unauthenticated == 401
        assert _get(f"http://127.0.0.1:{port}/api/tasks")[0] == 401
        assert _get(f"http://127.0.0.1:{port}/api/workers", auth="user:wrong")[0] == 401
        assert _get(f"http://127.0.0.1:{port}/api/workers", auth=SECRET)[0] == 200
        assert _get(f"http://127.0.0.1:{port}/api/tasks", auth=SECRET)[0] == 200
        # A web page in an operator's browser cannot drive Flower's controls with the browser's cached login.
        cross_site = urllib.request.Request(f"http://127.0.0.1:{port}/api/task/revoke/x", method="POST", data=b"")
        cross_site.add_header("Authorization", "Basic " + base64.b64encode(SECRET.encode()).decode())
        cross_site.add_header("Sec-Fetch-Site", "cross-site")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(cross_site, timeout=10)
        assert refused.value.code == 403
        # The entry point became Flower itself, and the password is in no process's command line.
        command_line = psutil.Process(flower.pid).cmdline()
        assert "flower" in command_line and not any("secret" in part for part in command_line)
    finally:
        stop_process_group(flower, timeout_s=30)
