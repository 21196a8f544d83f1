"""The monitoring files in deploy/: Prometheus's config and alerts (checked and unit-tested with promtool),
and the Grafana dashboard, which may use only metrics that the Monitoring section of docs/operations.md lists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.metric_names import (
    HISTOGRAM_SUFFIXES,
    catalog_metric_names,
    is_catalogued,
    referenced_metric_names,
)

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "batchery.json"
PROMTOOL_TIMEOUT_S = 60

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not on PATH (install Debian's `prometheus` package; .ci/run does)",
)


def promtool(*args: str) -> None:
    """Run promtool and fail with its output unless it succeeds."""
    try:
        result = subprocess.run(
            ["promtool", *args], cwd=REPO, capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"promtool {' '.join(args)} ran past {PROMTOOL_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    panels: list[dict[str, Any]] = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


def uncatalogued(names: set[str]) -> set[str]:
    catalog = catalog_metric_names()
    return {name for name in names if not is_catalogued(name, catalog)}


@needs_promtool
def test_the_prometheus_config_and_its_target_files_are_valid(tmp_path: Path) -> None:
    # As an operator installs it: the folder copied, the metrics token beside it (promtool checks it exists).
    installed = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, installed)
    (installed / "batchery_metrics_token").write_text("a-token\n")
    promtool("check", "config", str(installed / "prometheus.yml"))


@needs_promtool
def test_the_alert_rules_are_valid() -> None:
    promtool("check", "rules", "deploy/prometheus/alerts.yml")


@needs_promtool
def test_the_alert_unit_tests_pass() -> None:
    promtool("test", "rules", "deploy/prometheus/alerts_test.yml")


def test_every_alert_is_tested_both_firing_and_quiet() -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fires: set[str] = set()
    stays_quiet: set[str] = set()
    for group in tests:
        for case in group.get("alert_rule_test", []):
            expected = case.get("exp_alerts") or []
            (fires if expected else stays_quiet).add(case["alertname"])
            for alert in expected:
                assert alert["exp_labels"].get("severity"), f"{case['alertname']}: the severity is not checked"
                assert {"summary", "description"} <= set(alert["exp_annotations"]), (
                    f"{case['alertname']}: its summary and description are not checked"
                )
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fires == set(), "alerts never shown firing"
    assert names - stays_quiet == set(), "alerts never shown staying quiet"
    assert (fires | stays_quiet) - names == set(), "tests of alerts that alerts.yml does not have"


def test_every_alert_waits_has_a_severity_and_says_what_is_wrong() -> None:
    rules = alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules), "alert names repeat"
    for rule in rules:
        assert rule.get("for"), f"{rule['alert']} has no `for:`"
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"].get("summary") and rule["annotations"].get("description"), rule["alert"]


def test_the_alerts_use_only_catalogued_metrics() -> None:
    names = set().union(*(referenced_metric_names(rule["expr"]) for rule in alert_rules()))
    assert names, "no Batchery metric found in the alerts"
    assert uncatalogued(names) == set()


def test_the_dashboard_panels_have_unique_ids_and_each_a_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard_panels()
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    # Rows only group panels on the page; they hold no query of their own.
    for panel in panels:
        if panel["type"] != "row":
            assert any(target.get("expr", "").strip() for target in panel.get("targets", [])), panel["title"]
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert {"gpu_class", "tenant"} <= variables


def test_the_dashboard_uses_only_catalogued_metrics() -> None:
    names = referenced_metric_names(DASHBOARD.read_text())
    assert names, "no Batchery metric found in the dashboard"
    assert uncatalogued(names) == set()


@needs_promtool
def test_the_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each query, with Grafana's variables filled in, must load as a recording rule."""
    fill = {"$__rate_interval": "1m", "$__range": "1h", "$gpu_class": ".*", "$tenant": ".*"}
    rules = []
    for number, expr in enumerate(dashboard_expressions()):
        for variable, value in fill.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"a Grafana variable this test does not fill in: {expr}"
        rules.append({"record": f"dashboard:query_{number}", "expr": expr})
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    promtool("check", "rules", str(path))


def test_no_catalogued_metric_ends_like_a_histogram_series() -> None:
    """`referenced_metric_names` strips these suffixes unconditionally, which is only safe while this holds."""
    catalog = catalog_metric_names()
    assert "batchery_job_queue_wait_seconds" in catalog
    assert [name for name in catalog if name.endswith(HISTOGRAM_SUFFIXES)] == []


def test_referenced_metric_names_gives_base_names() -> None:
    text = """
        # HELP batchery_slot_busy_seconds Time the slot spent running a shard.
        histogram_quantile(0.95, sum by (le) (rate(batchery_job_queue_wait_seconds_bucket{tenant="acme"}[5m])))
        batchery_model_load_duration_seconds_count{host="gpu-a"} 3
        rate(batchery_slot_busy_seconds_total[5m]) / vllm:num_requests_running
        {__name__="batchery_slots_alive"} and not_batchery_thing
    """
    assert referenced_metric_names(text) == {
        "batchery_job_queue_wait_seconds",
        "batchery_model_load_duration_seconds",
        "batchery_slot_busy_seconds_total",
        "batchery_slots_alive",
        "vllm:num_requests_running",
    }


def test_the_example_targets_point_at_launcher_metrics_ports() -> None:
    files = sorted((PROMETHEUS / "targets" / "gpuworkers").glob("*.json"))
    assert files, "no example targets file"
    for path in files:
        for group in json.loads(path.read_text()):
            assert group["targets"], path.name
            assert all(re.fullmatch(r"[\w.-]+:9310", target) for target in group["targets"]), path.name
            assert "host" not in group.get("labels", {}), "a target's `host` label would clash with the metrics' own"
