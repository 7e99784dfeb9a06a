"""deploy/k8s/inference-gateway: the InferencePool against the Gateway API Inference Extension's
CRD schema (tests/deploy/crds, copied from its repository), the endpoint picker against
Kubernetes' schemas, and that the pieces fit: the pool selects the attnserve pods on their port,
its picker reference names the picker's Service, and every metric the picker's flags name is
one attnserve exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from attnserve.engine.prefix_cache import PrefixCache
from attnserve.service.metrics import Metrics
from tests.deploy.files import K8S_DIR, load_yaml, load_yaml_all

GATEWAY_DIR = K8S_DIR / "inference-gateway"
CRD = Path(__file__).parent / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
METRIC_FLAGS = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
    "cache-info-metric",
)


def documents() -> list[dict[str, Any]]:
    resources = load_yaml(GATEWAY_DIR / "kustomization.yaml")["resources"]
    assert sorted(resources) == sorted(p.name for p in GATEWAY_DIR.glob("*.yaml")
                                       if p.name != "kustomization.yaml")  # fmt: skip
    return [doc for name in resources for doc in load_yaml_all(GATEWAY_DIR / name)]


def of_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def pool_schema() -> dict[str, Any]:
    crd = load_yaml(CRD)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def check_pool(pool: dict[str, Any]) -> None:
    """The CRD's OpenAPI schema, and its CEL rules written out (jsonschema has no CEL)."""
    jsonschema.validate(pool, pool_schema())
    spec = pool["spec"]
    ref = spec["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("endpointPickerRef of a Service needs a port")
    numbers = [p["number"] for p in spec["targetPorts"]]
    if len(set(numbers)) != len(numbers):
        raise jsonschema.ValidationError("targetPorts repeat a port")


def test_the_pool_matches_the_crd_schema() -> None:
    pool = of_kind("InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    check_pool(pool)
    spec = pool["spec"]
    for broken in (
        {**spec, "targetPorts": []},
        {**spec, "targetPorts": [{"number": 70000}]},
        {**spec, "targetPorts": [{"number": 8000}, {"number": 8000}]},
        {**spec, "endpointPickerRef": {"name": "x"}},
        {**spec, "endpointPickerRef": {**spec["endpointPickerRef"], "failureMode": "Maybe"}},
        {k: v for k, v in spec.items() if k != "selector"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            check_pool({**pool, "spec": broken})


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_picker_matches_kubernetes_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="the PyPI package kubernetes-validate"
    )
    kinds = [d for d in documents() if d["kind"] != "InferencePool"]
    assert {d["kind"] for d in kinds} == {
        "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"
    }  # fmt: skip
    for doc in kinds:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_pieces_fit() -> None:
    pool = of_kind("InferencePool")["spec"]
    attnserve = load_yaml(K8S_DIR / "deployment.yaml")
    template = attnserve["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (server,) = template["spec"]["containers"]
    assert [p["number"] for p in pool["targetPorts"]] == [
        p["containerPort"] for p in server["ports"] if p["name"] == "http"
    ]
    service = of_kind("Service")
    picker = of_kind("Deployment")
    assert pool["endpointPickerRef"]["name"] == service["metadata"]["name"]
    assert pool["endpointPickerRef"]["port"]["number"] in [
        p["port"] for p in service["spec"]["ports"]
    ]
    assert (
        service["spec"]["selector"].items()
        <= picker["spec"]["template"]["metadata"]["labels"].items()
    )
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert args["pool-name"] == of_kind("InferencePool")["metadata"]["name"]
    assert args["grpc-port"] == str(pool["endpointPickerRef"]["port"]["number"])
    assert (
        picker["spec"]["template"]["spec"]["serviceAccountName"]
        == (of_kind("ServiceAccount")["metadata"]["name"])
    )
    rules = of_kind("Role")["rules"]
    assert any("inferencepools" in r["resources"] and "watch" in r["verbs"] for r in rules)
    assert any("pods" in r["resources"] and "list" in r["verbs"] for r in rules)


def exported() -> dict[str, str]:
    """name -> type of what a server with a language model (prefix cache on) exports."""
    metrics = Metrics()
    cache = PrefixCache(1 << 20, block=16)
    metrics.add_model(
        "lm", "int8", "CPUExecutionProvider", lambda: 2.0, lambda: 3.0, cache, lambda: 0.25
    )
    text = metrics.render()[0].decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def test_every_metric_the_picker_reads_is_exported() -> None:
    (container,) = of_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    types = exported()
    for flag in METRIC_FLAGS:
        name = args[flag].split("{")[0]
        assert types.get(name) == "gauge", (flag, name)
    assert args["lora-info-metric"] == ""  # attnserve serves no adapters
    hpa = load_yaml(K8S_DIR / "hpa.yaml")["spec"]["metrics"]
    for metric in hpa:
        assert types.get(metric["pods"]["metric"]["name"]) == "gauge"
