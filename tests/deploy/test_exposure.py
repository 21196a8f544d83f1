"""What the shipped deployments expose, rendered as the tools render them (`kubectl kustomize`, Compose's
interpolation, systemd's units and env files): /metrics asks for its token and no Ingress routes it,
Redis asks for a password (and speaks TLS where the deployment crosses hosts), and every broker URL
takes that password from a secret, never from a literal in the files."""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deployment_files import (
    COMPOSE_DIR,
    DEPLOY,
    KUBERNETES,
    PLACEHOLDER,
    compose_example_variables,
    compose_file,
    compose_interpolate,
    compose_service_env,
    env_file,
    find,
    kustomize,
    needs_kubectl,
)

BROKER_VARIABLES = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
SYSTEMD = DEPLOY / "systemd"
# A Redis URL with a password: redis[s]://[user]:password@host...
_PASSWORD_URL = re.compile(r"^rediss?://[^:@/]*:([^@/]+)@")


def _password(url: str) -> str | None:
    found = _PASSWORD_URL.match(url)
    return found[1] if found else None


# ---------------------------------------------------------------- Kubernetes (crosses hosts: pods on many nodes)


@pytest.fixture(scope="module")
def site() -> list[dict[str, Any]]:
    return kustomize(KUBERNETES / "site")


def _containers(site: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every container of every Deployment, the init containers that only migrate the database left out:
    they are the ones that talk to Redis."""
    found = []
    for deployment in find(site, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            if "migrate" not in container.get("command", []) + container.get("args", []):
                found.append((f"{deployment['metadata']['name']}/{container['name']}", container))
    return found


def _backend_for(rule: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The backend an Ingress rule sends `path` to, as Kubernetes says: an Exact match, else the longest Prefix."""
    exact = [p for p in rule["http"]["paths"] if p["pathType"] == "Exact" and p["path"] == path]
    if exact:
        return dict(exact[0]["backend"])
    prefixes = [
        p
        for p in rule["http"]["paths"]
        if p["pathType"] == "Prefix"
        and (p["path"] == "/" or path == p["path"].rstrip("/") or path.startswith(p["path"].rstrip("/") + "/"))
    ]
    return dict(max(prefixes, key=lambda p: len(p["path"]))["backend"]) if prefixes else None


@needs_kubectl
def test_no_ingress_path_routes_metrics_to_a_pod(site: list[dict[str, Any]]) -> None:
    services = {s["metadata"]["name"]: s for s in find(site, "Service")}
    ingresses = find(site, "Ingress")
    assert ingresses
    for ingress in ingresses:
        for rule in ingress["spec"]["rules"]:
            for path in ("/metrics", "/metrics/"):
                backend = _backend_for(rule, path)
                if backend is None:
                    continue
                service = services[backend["service"]["name"]]
                # A Service with no selector has no pods behind it: the controller answers 503.
                assert not service["spec"].get("selector"), f"{rule.get('host')}{path} reaches {service['metadata']}"
        # The portal's own pages stay routed.
        assert _backend_for(ingress["spec"]["rules"][0], "/api/v1/jobs/")["service"]["name"] == "portal"  # type: ignore[index]


@needs_kubectl
def test_every_container_that_talks_to_redis_gets_its_password_from_the_secret(site: list[dict[str, Any]]) -> None:
    containers = _containers(site)
    names = {name.split("/")[0] for name, _ in containers}
    assert {"portal", "control", "beat", "flower"} <= names and any(n.startswith("gpu-worker-") for n in names)
    for name, container in containers:
        env = {variable["name"]: variable for variable in container.get("env", [])}
        for variable in BROKER_VARIABLES:
            assert variable in env, f"{name}: no {variable} (it would fall back to a Redis without a password)"
            assert env[variable]["valueFrom"]["secretKeyRef"] == {"name": "batchery", "key": variable}, name
    # Nothing else hands a broker URL over: no ConfigMap holds one.
    for config_map in find(site, "ConfigMap"):
        assert not any(
            isinstance(value, str) and value.startswith(("redis://", "rediss://"))
            for value in config_map.get("data", {}).values()
        ), config_map["metadata"]["name"]


def test_the_secret_example_gives_redis_a_password_and_tls() -> None:
    secret = yaml.safe_load((KUBERNETES / "secret.example.yaml").read_text())["stringData"]
    for variable in BROKER_VARIABLES:
        url = secret[variable]
        # Pods talk to Redis across nodes: TLS, the server's certificate checked, and a password.
        assert url.startswith("rediss://") and "ssl_cert_reqs=required" in url, url
        assert _password(url) == PLACEHOLDER, url


@needs_kubectl
def test_metrics_need_the_token_from_the_secret_and_probes_use_healthz(site: list[dict[str, Any]]) -> None:
    serving = [
        (name, container)
        for name, container in _containers(site)
        if name.startswith(("portal/", "gpu-worker-")) and "/" in name
    ]
    assert len(serving) >= 3
    for name, container in serving:
        env = {variable["name"]: variable for variable in container.get("env", [])}
        assert env["BATCHERY_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "batchery", name
    for deployment in find(site, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                path = container.get(probe, {}).get("httpGet", {}).get("path")
                assert path != "/metrics", f"{deployment['metadata']['name']}: a probe cannot send the token"
    assert "BATCHERY_METRICS_TOKEN" in yaml.safe_load((KUBERNETES / "secret.example.yaml").read_text())["stringData"]


# ---------------------------------------------------------------- Compose (one Docker host)


def test_the_compose_redis_requires_the_password_every_broker_url_carries() -> None:
    variables = compose_example_variables()
    redis = compose_file()["services"]["redis"]
    command = " ".join(str(part) for part in redis["command"])
    assert '--requirepass "$$REDIS_PASSWORD"' in command
    assert compose_interpolate(str(redis["environment"]["REDIS_PASSWORD"]), variables) == variables["REDIS_PASSWORD"]
    assert redis["environment"]["REDISCLI_AUTH"] == redis["environment"]["REDIS_PASSWORD"], "the health check's"
    for service in ("portal", "control", "beat", "flower", "gpu-a100", "gpu-l4"):
        env = compose_service_env(service, variables)
        for variable in BROKER_VARIABLES:
            assert _password(env[variable]) == variables["REDIS_PASSWORD"], (service, variable)
    # From .env only: without it Compose refuses to start, and no password is written in the file.
    del variables["REDIS_PASSWORD"]
    with pytest.raises(AssertionError, match="requires REDIS_PASSWORD"):
        compose_service_env("control", variables)
    assert PLACEHOLDER not in (COMPOSE_DIR / "compose.yaml").read_text()


def test_the_compose_metrics_token_is_required_and_prometheus_sends_it() -> None:
    variables = compose_example_variables()
    for service in ("portal", "gpu-a100", "gpu-l4"):
        assert compose_service_env(service, variables)["BATCHERY_METRICS_TOKEN"] == variables["BATCHERY_METRICS_TOKEN"]
    del variables["BATCHERY_METRICS_TOKEN"]
    with pytest.raises(AssertionError, match="requires BATCHERY_METRICS_TOKEN"):
        compose_service_env("portal", variables)
    compose = compose_file()
    assert compose["secrets"]["metrics_token"] == {"environment": "BATCHERY_METRICS_TOKEN"}
    assert "metrics_token" in compose["services"]["prometheus"]["secrets"]
    _assert_every_job_sends_the_token(COMPOSE_DIR / "prometheus.yml", "/run/secrets/metrics_token")
    # The GPU services' health check reads the open /healthz, not /metrics.
    assert "/healthz" in " ".join(compose["services"]["gpu-a100"]["healthcheck"]["test"])


def _assert_every_job_sends_the_token(config: Path, credentials_file: str) -> None:
    jobs = yaml.safe_load(config.read_text())["scrape_configs"]
    assert jobs
    for job in jobs:
        assert job["authorization"] == {"credentials_file": credentials_file}, job["job_name"]


def test_the_site_prometheus_sends_the_token_to_every_batchery_target() -> None:
    _assert_every_job_sends_the_token(DEPLOY / "prometheus" / "prometheus.yml", "batchery_metrics_token")


# ---------------------------------------------------------------- systemd (crosses hosts: GPU hosts over the network)


def _service(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(SYSTEMD / name)
    return parser["Service"]


def test_every_systemd_unit_reads_the_env_file_that_holds_the_secrets() -> None:
    files = {
        "/etc/batchery/batchery.env": DEPLOY / "batchery.env.example",
        "/etc/batchery/gpuworkers.env": SYSTEMD / "gpuworkers.env.example",
    }
    units = sorted(path.name for path in SYSTEMD.glob("*.service"))
    assert len(units) >= 5
    for name in units:
        env_path = _service(name)["EnvironmentFile"]
        assert env_path in files, name
        env = env_file(files[env_path])
        # GPU hosts reach the broker over the network: TLS, the server's certificate checked, a password.
        for variable in BROKER_VARIABLES:
            url = env[variable]
            assert url.startswith("rediss://") and "ssl_cert_reqs=required" in url, (name, url)
            assert _password(url) == PLACEHOLDER, (name, url)
        assert env["BATCHERY_METRICS_TOKEN_FILE"] == "/etc/batchery/metrics_token", name


def test_the_redis_example_asks_for_a_password_and_speaks_tls_only() -> None:
    settings = dict(
        line.split(None, 1)
        for line in (SYSTEMD / "redis.conf.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert settings["requirepass"] == PLACEHOLDER
    assert settings["port"] == "0", "a plain-text port would carry the password in the clear"
    assert settings["tls-port"] == "6380"
    # The port the env files' URLs name.
    assert ":6380/" in env_file(SYSTEMD / "gpuworkers.env.example")["CELERY_BROKER_URL"]
