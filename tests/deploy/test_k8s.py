"""deploy/k8s: Kubernetes' schemas (kubernetes-validate, strict), and that the pieces fit: probes,
ports, GPU, drain time, the image's user and volume, selectors, the autoscaler's target."""

from __future__ import annotations

from typing import Any

import pytest

from attnserve.service.launch import ServeError, check_exposure
from tests.deploy.files import (
    K8S_DIR,
    dockerfile_stages,
    load_yaml,
    load_yaml_all,
    resolve_settings,
)

# Versions of Kubernetes' schemas to validate against: an older one still widely run, the newest.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# Kinds outside Kubernetes' own schemas, checked by the tests below instead.
CUSTOM_KINDS = {"ServiceMonitor", "Kustomization"}
LABELS = {"app.kubernetes.io/name": "attnserve"}
SHUTDOWN_MARGIN_SECONDS = 5


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one manifest of that kind in deploy/k8s."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in load_yaml_all(path):
            assert doc["kind"] not in found, f"two {doc['kind']} manifests"
            found[doc["kind"]] = doc
    return found


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    return manifests()


def container(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_match_kubernetes_schemas(k8s: dict[str, dict[str, Any]], version: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="the PyPI package kubernetes-validate"
    )
    for kind, doc in k8s.items():
        if kind not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)
    broken = {**k8s["Service"], "spec": {**k8s["Service"]["spec"], "selecter": LABELS}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_kustomization_lists_the_manifests(k8s: dict[str, dict[str, Any]]) -> None:
    resources = set(load_yaml(K8S_DIR / "kustomization.yaml")["resources"])
    optional = {"servicemonitor.yaml", "kustomization.yaml"}  # the CRD may be missing
    assert resources == {path.name for path in K8S_DIR.glob("*.yaml")} - optional
    (image,) = k8s["Kustomization"]["images"]
    assert image["name"] == container(k8s)["image"].split(":")[0]


def test_probes_and_ports(k8s: dict[str, dict[str, Any]]) -> None:
    main = container(k8s)
    (port,) = main["ports"]
    stage = dockerfile_stages()["gpu"]
    assert (port["name"], str(port["containerPort"])) == ("http", stage.all("EXPOSE")[0])
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    annotations = k8s["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"


def test_one_gpu_per_replica(k8s: dict[str, dict[str, Any]]) -> None:
    resources = container(k8s)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert container(k8s)["image"].endswith(":gpu")


def test_grace_period_covers_prestop_and_drain(
    k8s: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM comes after preStop; the drain then takes up to drain_seconds."""
    main = container(k8s)
    stage = dockerfile_stages()["gpu"]
    env = {**stage.env(), **{e["name"]: e["value"] for e in main["env"] if "value" in e}}
    settings = resolve_settings(monkeypatch, env, stage.exec_form("CMD"))
    command = main["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    needed = int(command[1]) + settings.drain_seconds + SHUTDOWN_MARGIN_SECONDS
    assert pod["terminationGracePeriodSeconds"] >= needed
    secret = [e for e in main["env"] if e["name"] == "ATTNSERVE_API_KEY"]
    assert secret and secret[0]["valueFrom"]["secretKeyRef"]["optional"] is False
    # The pod listens on every interface: without the key the server would refuse to start.
    with pytest.raises(ServeError, match="without an API key"):
        check_exposure(settings)
    keyed = {**env, "ATTNSERVE_API_KEY": "k3y"}
    check_exposure(resolve_settings(monkeypatch, keyed, stage.exec_form("CMD")))


def test_the_pod_runs_as_the_image_user_with_its_volume(k8s: dict[str, dict[str, Any]]) -> None:
    stage = dockerfile_stages()["gpu"]
    uid, gid = stage.last("USER").split(":")
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert (str(security["runAsUser"]), str(security["runAsGroup"])) == (uid, gid)
    main = container(k8s)
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {mount["mountPath"]: mount["name"] for mount in main["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for path in stage.volumes():
        assert "emptyDir" in volumes[mounts[path]]


def test_selectors_fit(k8s: dict[str, dict[str, Any]]) -> None:
    deployment = k8s["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == LABELS == pod_labels
    assert k8s["Service"]["spec"]["selector"] == LABELS
    assert k8s["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == LABELS
    (service_port,) = k8s["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == "http"
    monitor = k8s["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"] == k8s["Service"]["metadata"]["labels"]
    assert monitor["endpoints"][0]["port"] == service_port["name"]
    assert monitor["endpoints"][0]["path"] == "/metrics"
    # The ServiceMonitor's job label is the Service's name; the alerts select job="attnserve".
    assert k8s["Service"]["metadata"]["name"] == "attnserve"


def test_the_autoscaler_scales_the_deployment(k8s: dict[str, dict[str, Any]]) -> None:
    spec = k8s["HorizontalPodAutoscaler"]["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", k8s["Deployment"]["metadata"]["name"])
    assert 1 <= k8s["PodDisruptionBudget"]["spec"]["minAvailable"] < spec["minReplicas"]
    assert spec["minReplicas"] <= k8s["Deployment"]["spec"]["replicas"] <= spec["maxReplicas"]
