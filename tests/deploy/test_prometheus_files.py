"""deploy/prometheus: promtool checks the config and the rules and runs the alerts' unit tests;
the dashboard's queries are valid PromQL; every metric they and the alerts use is served."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import RuntimeServer
from tests.deploy.files import (
    DASHBOARD,
    K8S_DIR,
    PROMETHEUS_DIR,
    load_yaml,
    load_yaml_all,
    promql_metric_names,
    tool,
)

ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yml")
# Series that Prometheus makes itself, not the service.
PROMETHEUS_SERIES = {"up"}
# Grafana's variables, replaced by what they stand for in a query that promtool can parse.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = tool("promtool", "the Debian package prometheus")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: panel targets and template variables."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        # label_values(SELECTOR, LABEL): the selector is the query.
        query = variable["query"]["query"]
        queries.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return queries


def test_promtool_check_config() -> None:
    """The config and the rule files it loads (relative to it, as in the container)."""
    result = promtool("check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    """Each alert fires on synthetic series that should trip it and not on others."""
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_and_documented() -> None:
    fired = {
        case["alertname"]
        for test in load_yaml(ALERT_TESTS)["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    operations = (PROMETHEUS_DIR.parents[1] / "docs" / "OPERATIONS.md").read_text()
    for rule in alert_rules():
        assert rule["alert"] in fired, f"{rule['alert']} never fires in {ALERT_TESTS.name}"
        assert rule["alert"] in operations, f"{rule['alert']} is not in docs/OPERATIONS.md"
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"]) and "for" in rule


def test_the_dashboard_queries_are_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule."""
    rules = []
    for i, query in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": query})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def served_series(metrics_text: str) -> set[str]:
    """Sample names of a /metrics page: `x_total`, `x_bucket`, `x_sum`, `x_count`, gauges."""
    return {
        sample.name
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
    }


def test_the_series_parser_sees_histogram_and_counter_samples() -> None:
    text = (
        "# TYPE a_seconds histogram\n"
        'a_seconds_bucket{le="+Inf"} 1\na_seconds_sum 0.5\na_seconds_count 1\n'
        "# TYPE b counter\nb_total 3\n"
    )
    assert served_series(text) == {
        "a_seconds_bucket",
        "a_seconds_sum",
        "a_seconds_count",
        "b_total",
    }
    assert promql_metric_names(
        'histogram_quantile(0.9, sum by (le, model) (rate(a_seconds_bucket{job="x"}[5m])))'
        " / on (model) group_left sum(b_total offset 1h)"
    ) == {"a_seconds_bucket", "b_total"}


@pytest.mark.parametrize("source", ["dashboard", "alerts", "autoscaler"])
def test_every_metric_queried_is_served(runtime_server: RuntimeServer, source: str) -> None:
    """The running service (after a few requests) has samples of every metric that the
    dashboard, the alerts and the HorizontalPodAutoscaler use."""
    if source == "dashboard":
        queries = dashboard_queries()
    elif source == "alerts":
        queries = [rule["expr"] for rule in alert_rules()]
    else:
        (hpa,) = load_yaml_all(K8S_DIR / "hpa.yaml")
        queries = [metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]]
    served = served_series(runtime_server.metrics()) | PROMETHEUS_SERIES
    used = set().union(*(promql_metric_names(query) for query in queries))
    assert used, f"no metric names found in the {source}"
    assert not used - served, f"{source} queries metrics the service does not serve"
