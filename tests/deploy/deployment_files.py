"""Reading the deployment files as a tool would: Kustomize's rendering, Compose's interpolation, and
the environment each file gives a container, with the example secrets filled in."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE_DIR = DEPLOY / "compose"
GPU_CLASSES = ("a100-80gb", "l4-24gb")
PLACEHOLDER = "CHANGE-ME"
# Where the check --deploy runs point the portal: the suite's PostgreSQL, on a database of its own.
TEST_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/batchery_deploy"
KUSTOMIZE_TIMEOUT_S = 60

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not on PATH (it renders the Kustomize manifests)"
)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The manifests `kubectl kustomize <directory>` renders."""
    result = subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=KUSTOMIZE_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def generated_secret() -> str:
    """A value `check --deploy` accepts as SECRET_KEY: long, random, no `django-insecure-` prefix."""
    return secrets.token_urlsafe(50)


def fill_placeholder(name: str, value: str) -> str:
    """The example's value, or a usable one where the example holds a placeholder for a secret."""
    if PLACEHOLDER not in value:
        return value
    if name == "DATABASE_URL":
        return TEST_DATABASE_URL
    if "://" in value:
        # A URL that carries a password (the broker's): the password is the secret, the URL stays one.
        return value.replace(PLACEHOLDER, generated_secret())
    return generated_secret()


def kubernetes_secret_example() -> dict[str, str]:
    secret = yaml.safe_load((KUBERNETES / "secret.example.yaml").read_text())
    return {key: fill_placeholder(key, value) for key, value in secret["stringData"].items()}


_K8S_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(
    container: dict[str, Any], documents: list[dict[str, Any]], secret: Mapping[str, str], pod_ip: str = "10.0.0.7"
) -> dict[str, str]:
    """The environment the kubelet gives `container`: envFrom first, then env, with `$(VAR)` expanded."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in find(documents, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
        else:
            env.update(secret)
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = _K8S_REFERENCE.sub(lambda m: env.get(m[1], m[0]), variable["value"])
            continue
        source = variable["valueFrom"]
        if "secretKeyRef" in source:
            env[variable["name"]] = secret[source["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in source:
            reference = source["configMapKeyRef"]
            env[variable["name"]] = config_maps[reference["name"]][reference["key"]]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[variable["name"]] = pod_ip
        else:
            raise AssertionError(f"{variable['name']}: a valueFrom this test does not resolve: {source}")
    return env


def compose_file() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    return loaded


def compose_example_variables() -> dict[str, str]:
    """deploy/compose/env.example as Compose would read it from `.env`, with the secrets filled in."""
    variables = {}
    for line in (COMPOSE_DIR / "env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            variables[name.strip()] = fill_placeholder(name.strip(), value.strip())
    return variables


_COMPOSE_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def compose_interpolate(value: str, variables: Mapping[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}` and `$$`."""

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, operator, argument = match[1], match[2] or "", match[3] or ""
        value = variables.get(name)
        unset = value is None or (operator.startswith(":") and value == "")
        if operator.endswith("?") and unset:
            raise AssertionError(f"compose.yaml requires {name}: {argument}")
        if operator.endswith("-") and unset:
            return argument
        return value or ""

    return _COMPOSE_REFERENCE.sub(replace, value)


def compose_service_env(service: str, variables: Mapping[str, str]) -> dict[str, str]:
    """A service's environment as Compose hands it over (merge keys resolved by PyYAML)."""
    environment = compose_file()["services"][service].get("environment", {})
    assert isinstance(environment, dict), f"{service}: write `environment` as a mapping"
    return {name: compose_interpolate(str(value), variables) for name, value in environment.items()}


def env_file(path: Path) -> dict[str, str]:
    """A systemd EnvironmentFile's assignments (no quoting used in ours)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values
