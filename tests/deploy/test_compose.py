"""docker-compose.yml: the Compose specification's schema and parser, and what it wires up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from attnserve.service.launch import ServeError, check_exposure
from attnserve.service.security import HostPolicy
from tests.deploy.files import (
    COMPOSE,
    GRAFANA_DIR,
    PROMETHEUS_DIR,
    REPO,
    dockerfile_stages,
    duration_seconds,
    load_compose,
    load_yaml,
    resolve_settings,
    tool,
)

ATTNSERVE = {"attnserve": "gpu", "attnserve-cpu": "cpu"}  # service: profile and build target


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    checker = tool("check-jsonschema", "the PyPI package check-jsonschema")
    command = [checker, "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_compose_specification_schema_accepts_it(tmp_path: Path) -> None:
    """The file as written (interpolation, merge keys, x- fragments) against the schema
    that Docker Compose itself validates with."""
    result = _check_jsonschema(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    typo = tmp_path / "typo.yml"
    typo.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_perod:"))
    assert _check_jsonschema(typo).returncode == 1


def test_the_compose_spec_parser_accepts_it(compose: dict[str, Any]) -> None:
    """Values too (ports, durations, devices), after interpolation with no variables set."""
    compose_spec = pytest.importorskip("compose_spec", reason="the PyPI package compose-spec")
    parsed = compose_spec.PyCompose.from_yaml(yaml.safe_dump(compose))
    assert sorted(parsed.service_names()) == ["attnserve", "attnserve-cpu", "grafana", "prometheus"]
    broken = yaml.safe_dump(compose).replace("40s", "40 parsecs")
    with pytest.raises(ValueError, match="stop_grace_period"):
        compose_spec.PyCompose.from_yaml(broken)


@pytest.mark.parametrize("name", list(ATTNSERVE))
def test_attnserve_services(
    compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = compose["services"][name]
    target = ATTNSERVE[name]
    assert service["profiles"] == [target]
    assert service["build"] == {"context": ".", "target": target}
    assert service["image"] == f"attnserve:{target}"
    stage = dockerfile_stages()[target]
    (port,) = stage.all("EXPOSE")
    assert service["ports"] == [f"127.0.0.1:8000:{port}"]
    assert service["volumes"] == [f"attnserve-data:{path}" for path in stage.volumes()]
    assert service["read_only"] is True and service["tmpfs"] == ["/tmp"]
    assert service["networks"]["default"]["aliases"] == ["attnserve"]
    # The image's CMD with the service's environment over the image's.
    env = {**stage.env(), **service["environment"]}
    settings = resolve_settings(monkeypatch, env, stage.exec_form("CMD"))
    assert duration_seconds(service["stop_grace_period"]) >= settings.drain_seconds + 5
    # The image binds every interface of the container; the port is published on loopback.
    assert settings.host == "0.0.0.0" and settings.api_key is None
    assert not settings.open_beyond_loopback
    check_exposure(settings)  # starts
    # DNS rebinding: localhost's names and Prometheus' name for it, no other
    hosts = HostPolicy.from_settings(settings.exposed_host, settings.allowed_hosts)
    assert hosts.allows("localhost:8000") and hosts.allows("attnserve:8000")
    assert not hosts.allows("rebound.attacker.example:8000")


@pytest.mark.parametrize("name", list(ATTNSERVE))
def test_published_beyond_loopback_the_api_needs_a_key(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = load_compose({"PUBLISH_ADDRESS": "0.0.0.0"})
    service = opened["services"][name]
    assert service["ports"] == ["0.0.0.0:8000:8000"]
    stage = dockerfile_stages()[ATTNSERVE[name]]
    env = {**stage.env(), **service["environment"]}
    settings = resolve_settings(monkeypatch, env, stage.exec_form("CMD"))
    with pytest.raises(ServeError, match="without an API key: set ATTNSERVE_API_KEY"):
        check_exposure(settings)
    keyed = load_compose({"PUBLISH_ADDRESS": "0.0.0.0", "ATTNSERVE_API_KEY": "k3y"})
    env = {**stage.env(), **keyed["services"][name]["environment"]}
    check_exposure(resolve_settings(monkeypatch, env, stage.exec_form("CMD")))


def test_no_port_is_published_on_every_interface(compose: dict[str, Any]) -> None:
    """`docker compose config` with no variables set: every port on 127.0.0.1."""
    ports = {name: s.get("ports", []) for name, s in compose["services"].items()}
    assert all(ports.values()) and all(
        port.startswith("127.0.0.1:") for published in ports.values() for port in published
    ), ports


def test_only_the_gpu_service_reserves_a_gpu(compose: dict[str, Any]) -> None:
    devices = compose["services"]["attnserve"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in compose["services"]["attnserve-cpu"]


def test_prometheus_scrapes_the_service_and_loads_the_alerts(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    assert service["ports"] == ["127.0.0.1:9090:9090"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in service["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in service["command"]
    config = load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    assert all((PROMETHEUS_DIR / rules).is_file() for rules in config["rule_files"])
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "attnserve"]
    assert job["static_configs"] == [{"targets": ["attnserve:8000"]}]  # the services' alias


def test_grafana_is_provisioned(compose: dict[str, Any]) -> None:
    service = compose["services"]["grafana"]
    assert service["ports"] == ["127.0.0.1:3000:3000"]
    mounts = {}
    for volume in service["volumes"]:
        source, target, *_ = volume.split(":")
        mounts[target] = source
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    dashboards = mounts["/etc/grafana/dashboards"]
    assert (REPO / dashboards / "attnserve.json").is_file()
    home = service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/etc/grafana/dashboards/attnserve.json"
    provider = load_yaml(GRAFANA_DIR / "provisioning" / "dashboards" / "attnserve.yml")
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/dashboards"
    source = load_yaml(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")
    (datasource,) = source["datasources"]
    assert datasource["url"] == "http://prometheus:9090"  # the prometheus service and port


@pytest.mark.parametrize(
    ("password", "starts"), [(None, False), ("", False), ("admin", False), ("n0t-admin", True)]
)
def test_grafana_does_not_start_without_a_password(
    compose: dict[str, Any], password: str | None, starts: bool
) -> None:
    """The service's entrypoint, run by a real shell with Grafana's /run.sh replaced by echo."""
    service = compose["services"]["grafana"]
    assert service["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == ""  # no default
    shell, flag, script, name = service["entrypoint"]
    assert (shell, flag) == ("/bin/sh", "-c") and "exec /run.sh" in script
    env = {"PATH": os.environ["PATH"]}
    if password is not None:
        env["GF_SECURITY_ADMIN_PASSWORD"] = password
    script = script.replace("exec /run.sh", "exec echo started")
    result = subprocess.run(
        [shell, flag, script, name, "--flag"], env=env, capture_output=True, text=True, timeout=10
    )
    if starts:
        assert (result.returncode, result.stdout) == (0, "started --flag\n")
    else:
        assert result.returncode == 1 and result.stdout == ""
        assert "set GRAFANA_ADMIN_PASSWORD" in result.stderr
