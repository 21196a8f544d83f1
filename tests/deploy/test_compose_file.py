"""deploy/compose: the Compose file parses, runs every service a site needs with the commands the
systemd units use, and gives each GPU class its GPUs and nothing of the control side."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

from tests.deploy.deployment_files import (
    COMPOSE_DIR,
    REPO,
    compose_example_variables,
    compose_file,
    compose_service_env,
)
from tests.deploy.test_prometheus_files import needs_promtool, promtool

CONTROL_SERVICES = {
    *("proxy", "setup", "portal", "control", "planning", "webhooks", "validation", "beat", "flower"),
    *("redis", "postgres", "s3"),
}
MONITORING_SERVICES = {"prometheus", "grafana"}
GPU_SERVICES = {"gpu-a100": "a100-80gb", "gpu-l4": "l4-24gb"}
CONTROL_ONLY = {"DATABASE_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY"}


def services() -> dict[str, Any]:
    found: dict[str, Any] = compose_file()["services"]
    return found


def command(service: str) -> list[str]:
    value = services()[service]["command"]
    assert isinstance(value, list), f"{service}: write the command as a list, as Compose runs it without a shell"
    return [str(part) for part in value]


def test_the_compose_file_names_every_service_of_a_site() -> None:
    assert CONTROL_SERVICES | MONITORING_SERVICES | set(GPU_SERVICES) == set(services())


def test_the_batchery_services_run_the_commands_of_the_systemd_units() -> None:
    assert command("portal")[:2] == ["gunicorn", "portal.wsgi"]
    assert "--config=python:portal.gunicorn_conf" in command("portal")
    assert command("control")[:6] == ["celery", "--app", "tasks.app", "worker", "--queues", "control"]
    for queue in ("planning", "webhooks", "validation"):
        assert command(queue)[:6] == ["celery", "--app", "tasks.app", "worker", "--queues", queue]
    # Planning a large input takes minutes: its worker gets a control worker's time to stop.
    assert services()["planning"]["stop_grace_period"] == services()["control"]["stop_grace_period"]
    assert command("beat")[:4] == ["celery", "--app", "tasks.app", "beat"]
    assert command("flower") == ["python", "-m", "portal.ops.flower"]
    for service, gpu_class in GPU_SERVICES.items():
        assert command(service)[:4] == ["python", "-m", "gpuworkers", "launch"]
        assert command(service)[-2:] == ["--gpu-class", gpu_class]


def test_control_workers_scale_out_and_only_the_beat_service_runs_beat() -> None:
    assert services()["control"]["deploy"]["replicas"] == "${BATCHERY_CONTROL_REPLICAS:-1}"
    assert "BATCHERY_CONTROL_REPLICAS" in (COMPOSE_DIR / "env.example").read_text()
    # Every replica is its own node (%h: the container's name); a second beat would double-schedule.
    assert command("control")[-2:] == ["--hostname", "control@%h"]
    running_beat = [
        name for name in services() if {"beat", "--beat", "-B"} & set(services()[name].get("command") or [])
    ]
    assert running_beat == ["beat"]
    assert "replicas" not in services()["beat"].get("deploy", {})


@pytest.mark.parametrize("service", sorted(GPU_SERVICES))
def test_each_gpu_service_reserves_nvidia_gpus(service: str) -> None:
    [device] = services()[service]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert ("count" in device) != ("device_ids" in device), "Compose takes count or device_ids, not both"


@pytest.mark.parametrize("service", sorted(GPU_SERVICES))
def test_each_gpu_service_gets_the_broker_and_the_store_and_nothing_of_the_control_side(service: str) -> None:
    env = compose_service_env(service, compose_example_variables())
    assert {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BATCHERY_STORAGE_URL"} <= set(env)
    assert env["BATCHERY_STORAGE_URL"].startswith("s3://")
    assert set(env) & CONTROL_ONLY == set()
    assert not any(name.startswith(("DJANGO", "SECURE_", "CSRF_", "SESSION_")) for name in env)
    assert "env_file" not in services()[service], "an env file could hand the database over unseen"
    # The launcher gets time to let its slots finish or requeue their shards.
    grace_s = int(str(services()[service]["stop_grace_period"]).removesuffix("s"))
    assert grace_s > int(env["BATCHERY_SOFT_SHUTDOWN_S"])


def test_every_process_agrees_on_the_broker_the_storage_and_the_shard_time_limit() -> None:
    variables = compose_example_variables()
    batchery = ["portal", "control", "planning", "webhooks", "validation", "beat", "flower", *GPU_SERVICES]
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BATCHERY_STORAGE_URL", "BATCHERY_SHARD_TIME_LIMIT_S"):
        values = {compose_service_env(service, variables)[name] for service in batchery}
        assert len(values) == 1, f"{name} differs between services: {values}"


def test_the_secrets_must_be_given_and_are_not_in_the_file() -> None:
    variables = compose_example_variables()
    del variables["SECRET_KEY"]
    with pytest.raises(AssertionError, match="requires SECRET_KEY"):
        compose_service_env("portal", variables)
    assert "CHANGE-ME" not in (COMPOSE_DIR / "compose.yaml").read_text()


@needs_promtool
def test_the_compose_prometheus_config_is_valid() -> None:
    # Its rule file is a path inside the container (deploy/prometheus is mounted there).
    promtool("check", "config", "--syntax-only", "deploy/compose/prometheus.yml")


@pytest.mark.skipif(shutil.which("docker") is None, reason="docker is not on PATH")
def test_docker_compose_accepts_the_file() -> None:
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
    if plugin.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    env_file = COMPOSE_DIR / "env.example"
    result = subprocess.run(
        ["docker", "compose", "--env-file", str(env_file), "-f", str(COMPOSE_DIR / "compose.yaml"), "config", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
