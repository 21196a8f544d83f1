"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, the output validates against a pinned
Kubernetes release, each KEDA ScaledObject against the JSON schema of KEDA's spec beside this file, and
the GPU workers are what a GPU host must be: GPUs requested, on their class's nodes, given time to
finish a shard, and cut off from everything but the broker and the store."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.deployment_files import (
    GPU_CLASSES,
    KUBERNETES,
    container_env,
    find,
    kubernetes_secret_example,
    kustomize,
    needs_kubectl,
)
from tests.deploy.test_prometheus_files import needs_promtool, promtool
from tests.support.metric_names import catalog_metric_names, referenced_metric_names

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')"
)

# One release the schemas of kubernetes-validate cover; raise it with the clusters we support.
KUBERNETES_VERSION = "1.31.0"
KEDA_SCHEMA = Path(__file__).with_name("keda_scaledobject.schema.json")
OVERLAYS = [KUBERNETES / "overlays" / name for name in GPU_CLASSES]
RENDERED = [KUBERNETES / "base", *OVERLAYS, KUBERNETES / "site"]
# What may never reach a GPU worker: the database and Django's settings.
CONTROL_ONLY = {"DATABASE_URL", "DJANGO_SETTINGS_MODULE", "SECRET_KEY"}

pytestmark = needs_kubectl


@pytest.fixture(scope="module")
def site() -> list[dict[str, Any]]:
    return kustomize(KUBERNETES / "site")


def gpu_deployments(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in find(documents, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "gpu-worker"
    ]


def env_names(container: dict[str, Any], documents: list[dict[str, Any]]) -> set[str]:
    return set(container_env(container, documents, kubernetes_secret_example()))


@pytest.mark.parametrize("directory", RENDERED, ids=lambda path: path.relative_to(KUBERNETES).as_posix())
def test_each_kustomization_renders_and_validates_against_kubernetes(directory: Path) -> None:
    documents = kustomize(directory)
    assert documents
    # KEDA's CRDs are not in kubernetes-validate's schemas: ScaledObjects are checked by the next test.
    for document in documents:
        if document["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{document['kind']}/{document['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_the_secret_example_validates_and_names_every_key_the_manifests_use(site: list[dict[str, Any]]) -> None:
    secret = yaml.safe_load((KUBERNETES / "secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    used = {
        variable["valueFrom"]["secretKeyRef"]["key"]
        for deployment in find(site, "Deployment")
        for container in deployment["spec"]["template"]["spec"].get("initContainers", [])
        + deployment["spec"]["template"]["spec"]["containers"]
        for variable in container.get("env", [])
        if "secretKeyRef" in variable.get("valueFrom", {})
    }
    assert used <= set(secret["stringData"])
    # Never applied by accident: no kustomization lists it.
    assert find(site, "Secret") == []


def test_every_scaled_object_matches_kedas_spec_and_targets_its_class(site: list[dict[str, Any]]) -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    scaled_objects = find(site, "ScaledObject")
    assert {so["metadata"]["name"] for so in scaled_objects} == {f"gpu-worker-{name}" for name in GPU_CLASSES}
    deployments = {d["metadata"]["name"] for d in find(site, "Deployment")}
    for scaled_object in scaled_objects:
        jsonschema.validate(scaled_object, schema, cls=jsonschema.Draft202012Validator)
        gpu_class = scaled_object["metadata"]["labels"]["batchery.io/gpu-class"]
        spec = scaled_object["spec"]
        assert spec["scaleTargetRef"]["name"] == f"gpu-worker-{gpu_class}" in deployments
        assert spec["minReplicaCount"] == 0, "a class with no backlog holds no GPU"
        [trigger] = spec["triggers"]
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        assert referenced_metric_names(query) == {
            "batchery_queue_ready_messages",
            "batchery_queue_reserved_messages",
        }
        assert set(re.findall(r'queue_name="([^"]+)"', query)) == {f"gpu.{gpu_class}"}


def test_the_scaled_object_schema_refuses_what_keda_would_not_take(site: list[dict[str, Any]]) -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    scaled_object = find(site, "ScaledObject")[0]
    broken: list[dict[str, Any]] = []
    for mutate in (
        lambda so: so["spec"].pop("scaleTargetRef"),
        lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=1),
        lambda so: so["spec"]["triggers"][0]["metadata"].pop("query"),
        lambda so: so["spec"].update(minReplicas=0),
        lambda so: so["spec"]["triggers"][0].update(authenticationRef={"kind": "TriggerAuthentication"}),
    ):
        copy = json.loads(json.dumps(scaled_object))
        mutate(copy)
        broken.append(copy)
    for copy in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(copy, schema, cls=jsonschema.Draft202012Validator)


@needs_promtool
def test_the_scaling_queries_are_valid_promql(site: list[dict[str, Any]], tmp_path: Path) -> None:
    rules = [
        {
            "record": f"keda:{so['metadata']['name'].replace('-', '_')}",
            "expr": so["spec"]["triggers"][0]["metadata"]["query"],
        }
        for so in find(site, "ScaledObject")
    ]
    path = tmp_path / "keda_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    promtool("check", "rules", str(path))
    assert {"batchery_queue_ready_messages", "batchery_queue_reserved_messages"} <= catalog_metric_names()


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda path: path.name)
def test_each_gpu_overlay_runs_its_class_on_its_gpus_and_nodes(overlay: Path) -> None:
    documents = kustomize(overlay)
    [deployment] = gpu_deployments(documents)
    gpu_class = overlay.name
    pod = deployment["spec"]["template"]["spec"]
    [launcher] = pod["containers"]
    assert launcher["command"][:4] == ["python", "-m", "gpuworkers", "launch"]
    assert "--gpu-class=$(BATCHERY_GPU_CLASS)" in launcher["command"]
    assert {"name": "BATCHERY_GPU_CLASS", "value": gpu_class} in launcher["env"]
    resources = launcher["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    assert pod["nodeSelector"], "no node selector: the pod could land on any GPU"
    assert {"key": "batchery.io/gpu-class", "operator": "Equal", "value": gpu_class, "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert "replicas" not in deployment["spec"], "KEDA owns the replica count; an apply must not reset it"


def test_gpu_workers_get_time_to_finish_their_shard(site: list[dict[str, Any]]) -> None:
    secret = kubernetes_secret_example()
    deployments = gpu_deployments(site)
    assert len(deployments) == len(GPU_CLASSES)
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        env = container_env(pod["containers"][0], site, secret)
        # As tasks.shared.config reads it: the soft shutdown defaults to the shard time limit, which defaults to 3600.
        soft_shutdown = int(env.get("BATCHERY_SOFT_SHUTDOWN_S", env.get("BATCHERY_SHARD_TIME_LIMIT_S", "3600")))
        assert pod["terminationGracePeriodSeconds"] > soft_shutdown, deployment["metadata"]["name"]


def test_gpu_workers_get_the_broker_and_the_store_and_nothing_of_the_control_side(
    site: list[dict[str, Any]],
) -> None:
    for deployment in gpu_deployments(site):
        pod = deployment["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert not any("secretRef" in source for source in container.get("envFrom", [])), (
                "a whole Secret would hand over DATABASE_URL and SECRET_KEY"
            )
            names = env_names(container, site)
            assert {"CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "BATCHERY_STORAGE_URL"} <= names
            assert names & CONTROL_ONLY == set(), deployment["metadata"]["name"]
            assert not any(name.startswith(("DJANGO", "SECURE_", "CSRF_", "SESSION_")) for name in names)


def test_network_policies_let_gpu_workers_reach_only_the_broker_the_store_and_dns(
    site: list[dict[str, Any]],
) -> None:
    policies = [
        p
        for p in find(site, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/component") == "gpu-worker"
    ]
    egress = [rule for p in policies if "Egress" in p["spec"]["policyTypes"] for rule in p["spec"].get("egress", [])]
    ingress = [rule for p in policies if "Ingress" in p["spec"]["policyTypes"] for rule in p["spec"].get("ingress", [])]
    assert egress and ingress, "GPU workers have no egress or no ingress policy"
    egress_ports = sorted(port["port"] for rule in egress for port in rule["ports"])
    assert egress_ports == [53, 53, 6379, 9000], "egress beyond DNS, Redis and the object store"
    assert all(rule.get("to") for rule in egress), "an egress rule open to every destination"
    assert [port["port"] for rule in ingress for port in rule["ports"]] == [9310]
    [source] = [peer for rule in ingress for peer in rule["from"]]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    # Each peer the policy allows is the one the ConfigMap and the Secret name.
    common = find(site, "ConfigMap", "batchery-common")[0]["data"]
    assert ":6379/" in kubernetes_secret_example()["CELERY_BROKER_URL"] and common["AWS_ENDPOINT_URL"].endswith(":9000")


def test_planning_webhooks_and_validations_have_workers_of_their_own_off_the_control_lane(
    site: list[dict[str, Any]],
) -> None:
    for queue in ("control", "planning", "webhooks", "validation"):
        [deployment] = find(site, "Deployment", queue)
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"][:6] == ["celery", "--app", "tasks.app", "worker", "--queues", queue]
        assert {"DATABASE_URL", "SECRET_KEY"} <= env_names(container, site)
    # Planning a large input takes minutes: its workers get a control worker's time to stop.
    [control], [planning] = find(site, "Deployment", "control"), find(site, "Deployment", "planning")
    grace = "terminationGracePeriodSeconds"
    assert planning["spec"]["template"]["spec"][grace] == control["spec"]["template"]["spec"][grace]


def test_the_control_side_has_disruption_budgets_probes_and_requests(site: list[dict[str, Any]]) -> None:
    budgets = {
        p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for p in find(site, "PodDisruptionBudget")
    }
    assert {"portal", "control"} <= budgets
    [beat] = find(site, "Deployment", "beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate", "two beats double-schedule"
    # Control workers scale out (any number share the control queue), none of them with beat.
    [control] = find(site, "Deployment", "control")
    assert control["spec"]["replicas"] >= 2
    running_beat = [
        deployment["metadata"]["name"]
        for deployment in find(site, "Deployment")
        for container in deployment["spec"]["template"]["spec"]["containers"]
        if {"beat", "--beat", "-B"} & set(container.get("command") or [])
    ]
    assert running_beat == ["beat"]
    for deployment in find(site, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["resources"]["requests"].get("cpu"), deployment["metadata"]["name"]
            assert container["resources"]["requests"].get("memory"), deployment["metadata"]["name"]
            if deployment["metadata"]["name"] != "beat":
                assert "livenessProbe" in container, deployment["metadata"]["name"]
    for name in ("portal", "flower"):
        assert find(site, "Service", name), f"no Service for {name}"
    [portal] = find(site, "Deployment", "portal")
    annotations = portal["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
