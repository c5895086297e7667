"""KubeRay manifests: Kubernetes schemas (kubernetes-validate), the KubeRay CRDs' openAPIV3Schema,
Ray Serve's own config schema, and our typed AppConfig for the inline Serve config."""
from __future__ import annotations

import copy
import importlib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deployments import serve_env
from deployments.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
CRDS = K8S / "crds"  # vendored from KubeRay (k8s/crds/SOURCE)
K8S_VERSION = "1.30.0"


def _strict(schema: dict) -> dict:
    """Reject unknown fields, as the API server's strict field validation (kubectl --validate=strict) does;
    a CRD schema alone only prunes them. Objects marked x-kubernetes-preserve-unknown-fields stay open."""
    if isinstance(schema, dict):
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in schema.values():
            if isinstance(value, dict):
                _strict(value)
            elif isinstance(value, list):
                for item in value:
                    _strict(item)
    return schema


def _crd_schema(kind: str) -> dict:
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(version["schema"]["openAPIV3Schema"])
    # apiVersion/kind/metadata are checked by the API server itself, not by the CRD schema.
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def _documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or CRDS in path.parents:
            continue
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCUMENTS = _documents()
RAYSERVICES = [(p, d) for p, d in DOCUMENTS if d["kind"] == "RayService"]


def test_there_is_a_cpu_and_a_gpu_rayservice():
    assert {p.parent.name for p, _ in RAYSERVICES} == {"cpu", "gpu"}


@pytest.mark.parametrize("path,doc", DOCUMENTS, ids=[f"{p.relative_to(K8S)}:{d['kind']}" for p, d in DOCUMENTS])
def test_manifest_is_valid(path, doc):
    if doc["apiVersion"].startswith("ray.io/"):
        jsonschema.validate(doc, _crd_schema(doc["kind"]))
    elif doc["apiVersion"] == "monitoring.coreos.com/v1":
        # prometheus-operator's CRDs are not vendored: the shape here, the rules inside by promtool
        # (test_alerts.py), the PodMonitor's endpoints below
        assert doc["kind"] in ("PrometheusRule", "PodMonitor") and set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        assert doc["metadata"]["name"]
        if doc["kind"] == "PrometheusRule":
            assert set(doc["spec"]) == {"groups"}
        else:
            assert set(doc["spec"]) == {"jobLabel", "selector", "podMetricsEndpoints"}
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod_templates(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


@pytest.mark.parametrize("path,doc", RAYSERVICES, ids=[p.parent.name for p, _ in RAYSERVICES])
def test_pod_templates_are_valid_pods_that_leave_probes_to_kuberay_and_name_their_ports(path, doc):
    for template in _pod_templates(doc):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": copy.deepcopy(template.get("metadata", {})) | {"name": "x"},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        container = template["spec"]["containers"][0]
        # KubeRay injects its probes only into Ray containers that set none (worker readiness on the Serve
        # proxy with failureThreshold 1, so a worker whose proxy died leaves the Service at once)
        assert "readinessProbe" not in container and "livenessProbe" not in container
        assert {"serve", "metrics"} <= {p["name"] for p in container["ports"]}


@pytest.mark.parametrize("path,doc", RAYSERVICES, ids=[p.parent.name for p, _ in RAYSERVICES])
def test_every_ray_container_starts_with_the_serve_environment_make_serve_gives(path, doc):
    for template in _pod_templates(doc):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0].get("env", [])}
        assert {name: env.get(name) for name in serve_env.SERVE_ENV} == serve_env.SERVE_ENV
        assert serve_env.THROUGHPUT_SWITCH not in env  # as make serve: Serve's data plane as Ray ships it


@pytest.mark.parametrize("path,doc", RAYSERVICES, ids=[p.parent.name for p, _ in RAYSERVICES])
def test_inline_serve_config_parses_into_ray_and_our_config(path, doc):
    from ray.serve.schema import ServeDeploySchema

    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(serve_config)
    for app in serve_config["applications"]:
        module, attr = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        config = AppConfig.model_validate(app["args"])
        assert config.autoscaling is not None and config.queue_bound() > 0
        head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]
        assert head["rayStartParams"]["num-cpus"] == "0"  # no engine on the head
        workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        limits = workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert float(limits["cpu"]) >= config.num_cpus_per_replica
        if config.num_gpus_per_replica:
            assert int(limits["nvidia.com/gpu"]) >= config.num_gpus_per_replica
            assert not config.model.startswith("default")


@pytest.mark.parametrize("path,doc", RAYSERVICES, ids=[p.parent.name for p, _ in RAYSERVICES])
def test_no_deprecated_rayservice_fields(path, doc):
    # KubeRay documents both as "not used anymore" (kuberay issue 1685): setting them changes nothing
    assert not {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} & set(doc["spec"])


def test_strict_schema_catches_a_misspelled_field():
    _, doc = RAYSERVICES[0]
    broken = copy.deepcopy(doc)
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _crd_schema("RayService"))


def test_kustomizations_reference_existing_files():
    for path in K8S.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(path.read_text())["resources"]:
            assert (path.parent / resource).exists(), (path, resource)


def test_metrics_are_scraped_once_per_pod_from_ray_and_the_merged_page_is_not_discovered():
    """The merged /metrics page is the same on every pod's proxy: a Service annotated for scraping would
    be scraped once per pod. Prometheus reads each pod's Ray metrics agent instead (the PodMonitor), with
    the renames of monitoring/prometheus-ray.yml, from a port every Ray pod names."""
    (monitor,) = [d for _, d in DOCUMENTS if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ray_config = yaml.safe_load((K8S.parent / "monitoring" / "prometheus-ray.yml").read_text())
    (job,) = ray_config["scrape_configs"]
    camel = {"source_labels": "sourceLabels", "target_label": "targetLabel"}
    assert endpoint["metricRelabelings"] == [{camel.get(k, k): v for k, v in rule.items()}
                                             for rule in job["metric_relabel_configs"]]
    for _, doc in RAYSERVICES:
        assert "prometheus.io/scrape" not in doc["spec"]["serveService"]["metadata"].get("annotations", {})
        cluster = doc["spec"]["rayClusterConfig"]
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            assert group["rayStartParams"]["metrics-export-port"] == "8080"
        for template in _pod_templates(doc):
            labels = template["metadata"]["labels"]
            assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
            assert labels[monitor["spec"]["jobLabel"]] == job["job_name"]  # the job the alerts name
            ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
            assert ports[endpoint["port"]] == 8080
