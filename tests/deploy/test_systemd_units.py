"""deploy/systemd, kept in step with Compose and Kubernetes: the same commands, the control host's
environment example for the control side only, and a GPU host's unit that needs no Django at all."""

from __future__ import annotations

import configparser
import shlex

from tests.deploy.deployment_files import DEPLOY, env_file

SYSTEMD = DEPLOY / "systemd"
CONTROL_ONLY = {"DATABASE_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY", "SECRET_KEY_FILE"}


def unit(name: str) -> configparser.SectionProxy:
    # strict=False: a unit may repeat a key (Environment=), which configparser otherwise refuses.
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(SYSTEMD / name)
    return parser["Service"]


def command(name: str) -> list[str]:
    return shlex.split(unit(name)["ExecStart"])


def test_the_units_run_the_commands_of_compose_and_kubernetes() -> None:
    assert command("batchery-portal.service")[1:2] == ["portal.wsgi"]
    assert "python:portal.gunicorn_conf" in command("batchery-portal.service")
    assert command("batchery-control.service")[1:6] == ["--app", "tasks.app", "worker", "--queues", "control"]
    # Planning, webhook deliveries and batch validations run off the control lane, on workers of their own.
    for queue in ("planning", "webhooks", "validation"):
        assert command(f"batchery-{queue}.service")[1:6] == ["--app", "tasks.app", "worker", "--queues", queue]
        assert unit(f"batchery-{queue}.service")["EnvironmentFile"] == "/etc/batchery/batchery.env"
    # Planning a large input takes minutes: its worker gets a control worker's time to stop.
    assert unit("batchery-planning.service")["TimeoutStopSec"] == unit("batchery-control.service")["TimeoutStopSec"]
    assert command("batchery-beat.service")[1:4] == ["--app", "tasks.app", "beat"]
    assert command("batchery-flower.service")[1:] == ["-m", "portal.ops.flower"]
    assert command("batchery-gpuworkers.service")[1:4] == ["-m", "gpuworkers", "launch"]


def test_more_control_workers_on_a_host_are_instances_of_a_template_without_beat() -> None:
    single, template = command("batchery-control.service"), command("batchery-control@.service")
    assert template[:-1] == single[:-1], "the same worker as batchery-control, under another node name"
    assert (single[-1], template[-1]) == ("control@%%H", "control-%i@%%H")
    assert unit("batchery-control@.service")["EnvironmentFile"] == unit("batchery-control.service")["EnvironmentFile"]
    running_beat = [
        path.name for path in SYSTEMD.glob("*.service") if {"beat", "--beat", "-B"} & set(command(path.name))
    ]
    assert running_beat == ["batchery-beat.service"]


def test_the_gpu_host_reads_an_environment_without_the_database_or_django() -> None:
    service = unit("batchery-gpuworkers.service")
    assert service["EnvironmentFile"] == "/etc/batchery/gpuworkers.env"
    env = env_file(SYSTEMD / "gpuworkers.env.example")
    assert {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BATCHERY_STORAGE_URL"} <= set(env)
    assert set(env) & CONTROL_ONLY == set()
    assert not any(name.startswith(("DJANGO", "SECURE_", "CSRF_", "SESSION_")) for name in env)
    # systemd waits for the slots to finish or requeue their shards before it kills the launcher.
    assert int(service["TimeoutStopSec"]) > int(env["BATCHERY_SOFT_SHUTDOWN_S"])


def test_both_hosts_agree_on_the_broker_the_storage_and_the_shard_time_limit() -> None:
    control = env_file(DEPLOY / "batchery.env.example")
    gpu = env_file(SYSTEMD / "gpuworkers.env.example")
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BATCHERY_STORAGE_URL", "BATCHERY_SHARD_TIME_LIMIT_S"):
        assert control[name] == gpu[name], name
