"""The Grafana dashboard: valid JSON with the panels operators look for, all on the provisioned
datasource. (That its metrics are served: test_prometheus_files.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.deploy.files import DASHBOARD, GRAFANA_DIR, load_yaml

GRID_COLUMNS = 24
# What the dashboard must show: a title fragment -> metrics one of that panel's queries uses.
REQUIRED_PANELS = {
    "Request rate": "attnserve_requests_total",
    "Request latency percentiles": "attnserve_request_duration_seconds_bucket",
    "Time to first token": "attnserve_time_to_first_token_seconds_bucket",
    "Tokens per second": "attnserve_output_tokens_total",
    "Batch rows": "attnserve_batch_rows_",
    "Queue depth": "attnserve_requests_waiting",
    "Rejections": "attnserve_rejected_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def test_dashboard_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "attnserve" and dashboard["title"] == "attnserve"
    assert "id" not in dashboard, "a provisioned dashboard carries no database id"
    assert isinstance(dashboard["schemaVersion"], int)


def test_panels_are_laid_out_and_distinct(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= GRID_COLUMNS
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"panel {panel['title']!r} overlaps another"
        cells |= area
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert panel["targets"] and len(ref_ids) == len(set(ref_ids))


def test_every_query_uses_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    (datasource,) = load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")[
        "datasources"
    ]
    expected = {"type": datasource["type"], "uid": datasource["uid"]}
    variables = dashboard["templating"]["list"]
    for item in [*dashboard["panels"], *variables]:
        assert item["datasource"] == expected, item.get("title", item.get("name"))
    for panel in dashboard["panels"]:
        assert all(target["datasource"] == expected for target in panel["targets"])


@pytest.mark.parametrize("title", list(REQUIRED_PANELS))
def test_required_panels(dashboard: dict[str, Any], title: str) -> None:
    (panel,) = [p for p in dashboard["panels"] if p["title"].startswith(title)]
    assert any(REQUIRED_PANELS[title] in target["expr"] for target in panel["targets"])
    assert panel["description"]
