"""`manage.py check --deploy` passes with the environment each deployment file gives the portal: the
Kubernetes ConfigMaps and Secret example, the Compose file with its env example, and the systemd
environment example. Only secrets and database URLs that are placeholders are filled in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.deployment_files import (
    DEPLOY,
    KUBERNETES,
    REPO,
    TEST_DATABASE_URL,
    compose_example_variables,
    compose_service_env,
    container_env,
    env_file,
    find,
    generated_secret,
    kubernetes_secret_example,
    kustomize,
    needs_kubectl,
)

CHECK_TIMEOUT_S = 180
SHOW_SETTINGS = (
    "import json; from django.conf import settings; "
    "print(json.dumps({'proxy_ssl_header': settings.SECURE_PROXY_SSL_HEADER, 'debug': settings.DEBUG}))"
)
# What `check --deploy` reports without them; each deployment file must set every one.
SECURITY_SETTINGS = {
    "DEBUG",
    "ALLOWED_HOSTS",
    "SECURE_PROXY_SSL_HEADER",
    "SECURE_SSL_REDIRECT",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
}


def _process_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    # The files' database hosts exist only in their own networks; the check itself opens no connection.
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "BATCHERY_VAR_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "portal.settings",
        **env,
        "DATABASE_URL": TEST_DATABASE_URL,
    }


def check_deploy(env: dict[str, str], tmp_path: Path) -> None:
    """Run the check in a process of its own, with this environment and nothing of the test run's."""
    process_env = _process_env(env, tmp_path)
    try:
        result = subprocess.run(
            [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
            cwd=REPO,
            env=process_env,
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"check --deploy ran past {CHECK_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"check --deploy failed:\n{result.stdout}\n{result.stderr}"
    assert "no issues" in result.stdout, result.stdout
    # The check does not look at the proxy's header; a request through the proxy must count as HTTPS.
    shown = subprocess.run(
        [sys.executable, "-c", SHOW_SETTINGS],
        cwd=REPO,
        env=process_env,
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
        check=True,
    )
    assert json.loads(shown.stdout) == {"proxy_ssl_header": ["HTTP_X_FORWARDED_PROTO", "https"], "debug": False}


@needs_kubectl
def test_check_deploy_passes_with_the_kubernetes_portal_environment(tmp_path: Path) -> None:
    documents: list[dict[str, Any]] = kustomize(KUBERNETES / "base")
    [portal] = find(documents, "Deployment", "portal")
    [container] = [c for c in portal["spec"]["template"]["spec"]["containers"] if c["name"] == "portal"]
    env = container_env(container, documents, kubernetes_secret_example())
    assert set(env) >= SECURITY_SETTINGS
    assert env["ALLOWED_HOSTS"].endswith(",10.0.0.7"), "probes and Prometheus reach the pod by its IP"
    check_deploy(env, tmp_path)


def test_check_deploy_passes_with_the_compose_portal_environment(tmp_path: Path) -> None:
    env = compose_service_env("portal", compose_example_variables())
    assert set(env) >= SECURITY_SETTINGS
    check_deploy(env, tmp_path)


def test_check_deploy_passes_with_the_systemd_environment_example(tmp_path: Path) -> None:
    env = env_file(DEPLOY / "batchery.env.example")
    assert set(env) >= SECURITY_SETTINGS
    # The unit reads SECRET_KEY from the file SECRET_KEY_FILE names.
    secret_key = tmp_path / "secret_key"
    secret_key.write_text(generated_secret())
    env["SECRET_KEY_FILE"] = str(secret_key)
    # And the metrics token from the file BATCHERY_METRICS_TOKEN_FILE names.
    assert env["BATCHERY_METRICS_TOKEN_FILE"] == "/etc/batchery/metrics_token"
    metrics_token = tmp_path / "metrics_token"
    metrics_token.write_text(generated_secret())
    env["BATCHERY_METRICS_TOKEN_FILE"] = str(metrics_token)
    check_deploy(env, tmp_path)


def test_check_deploy_refuses_a_portal_whose_metrics_ask_for_no_token(tmp_path: Path) -> None:
    env = compose_service_env("portal", compose_example_variables())
    del env["BATCHERY_METRICS_TOKEN"]
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO,
        env=_process_env(env, tmp_path),
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
        check=False,
    )
    assert result.returncode != 0
    assert "batchery.W001" in result.stderr + result.stdout and "BATCHERY_METRICS_TOKEN" in result.stderr


def test_the_local_defaults_stay_plain_http() -> None:
    """`up` on a laptop serves http://127.0.0.1:8000: nothing redirects it or marks its cookies secure."""
    from django.conf import settings

    if any(name in os.environ for name in SECURITY_SETTINGS - {"DEBUG", "ALLOWED_HOSTS"}):
        pytest.skip("the test run's environment sets HTTPS settings itself")
    assert settings.SECURE_SSL_REDIRECT is False
    assert settings.SECURE_PROXY_SSL_HEADER is None
    assert settings.SECURE_HSTS_SECONDS == 0
    assert settings.SESSION_COOKIE_SECURE is False and settings.CSRF_COOKIE_SECURE is False
