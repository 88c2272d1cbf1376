"""The deployment files are valid and agree with the code: Kubernetes manifests against the Kubernetes
schemas (kubernetes-validate, strict: unknown fields fail), the Grafana dashboard against the structure Grafana
loads and the metrics corral exports, and docker-compose.yml against the settings corral reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from corral.server.settings import Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
DASHBOARD = REPO / "deploy" / "monitoring" / "grafana" / "dashboards" / "corral.json"
K8S_VERSION = "1.33.0"  # oldest Kubernetes release the manifests promise to work on
NOT_K8S_OBJECTS = {"kustomization.yaml", "prometheus-adapter-values.yaml"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_K8S_OBJECTS)


def _objects() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for p in _manifests() for d in _docs(p)}


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(path: Path) -> None:
    for doc in _docs(path):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validator_rejects_a_misspelt_field() -> None:
    deployment = _objects()["Deployment"]
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = _docs(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(p.name for p in _manifests())


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_deployment_runs_on_a_gpu_with_health_probes_and_bounded_shutdown() -> None:
    objects = _objects()
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == int(_env(container)["CORRAL_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # The pod must outlive preStop + corral's own drain, or Kubernetes SIGKILLs requests corral would finish.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = int(pre_stop[1]) + int(_env(container)["CORRAL_SHUTDOWN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 5
    assert pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/model"]["readOnly"] is True


def test_service_pdb_and_hpa_point_at_the_deployment() -> None:
    objects = _objects()
    deployment = objects["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert objects["Service"]["spec"]["selector"].items() <= labels.items()
    assert objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = objects["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "corral_waiting_requests"
    (adapter,) = _docs(K8S / "prometheus-adapter-values.yaml")
    assert adapter["rules"]["custom"][0]["name"]["as"] == "corral_waiting_requests"
    backend = objects["Ingress"]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == objects["Service"]["metadata"]["name"]


# --- Grafana dashboard ---------------------------------------------------------------------------------------

# The part of Grafana's dashboard model that provisioning needs to load a dashboard with these panels.
DASHBOARD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "refresh": {"type": "string"},
        "templating": {"type": "object", "required": ["list"]},
        "panels": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
                "properties": {
                    "id": {"type": "integer"},
                    "type": {"enum": ["timeseries", "stat", "gauge", "bargauge", "table", "heatmap"]},
                    "gridPos": {
                        "type": "object",
                        "required": ["x", "y", "w", "h"],
                        "properties": {
                            "x": {"type": "integer", "minimum": 0, "maximum": 23},
                            "w": {"type": "integer", "minimum": 1, "maximum": 24},
                        },
                    },
                    "targets": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "object", "required": ["refId", "expr"]},
                    },
                },
            },
        },
    },
}


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def test_dashboard_loads_and_matches_grafanas_model() -> None:
    import jsonschema

    dashboard = _dashboard()
    jsonschema.validate(dashboard, DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_dashboard_plots_what_operators_need_from_metrics_corral_exports() -> None:
    from corral.server.metrics import Metrics

    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",), "gauge": ("",)}
    exported = {f.name + s for f in Metrics().registry.collect() for s in suffixes.get(f.type, ("",))}
    titles = " | ".join(p["title"] for p in _dashboard()["panels"]).lower()
    for needed in ("ttft", "tpot", "tokens per second", "compile", "cache", "finish reasons", "watchdog"):
        assert needed in titles, needed
    for panel in _dashboard()["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bcorral_[a-z_]+", target["expr"]):
                assert name in exported, f"{panel['title']}: {name} is not a metric corral exports"


# --- docker compose --------------------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    (data,) = _docs(REPO / "docker-compose.yml")
    return data


def test_compose_passes_every_corral_setting_through() -> None:
    env = _compose()["services"]["corral"]["environment"]
    missing = [f"CORRAL_{name.upper()}" for name in Settings.model_fields if f"CORRAL_{name.upper()}" not in env]
    assert not missing, f"add to docker-compose.yml services.corral.environment: {missing}"
    # Inside the container corral must listen where the balancer and the healthcheck look.
    assert env["CORRAL_HOST"] == "0.0.0.0"
    assert env["CORRAL_PORT"] == "8000"


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", value)
    assert match, value
    return int(match[1]) * (60 if match[2] == "m" else 1)


def test_compose_service_is_supervised_gpu_backed_and_drains_within_its_grace() -> None:
    corral = _compose()["services"]["corral"]
    assert corral["restart"] == "unless-stopped"
    (device,) = corral["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "/health" in " ".join(corral["healthcheck"]["test"])
    grace = _seconds(re.sub(r"\$\{[A-Z_]+:-(.+)\}", r"\1", corral["stop_grace_period"]))
    shutdown = float(re.sub(r"\$\{[A-Z_]+:-(.+)\}", r"\1", corral["environment"]["CORRAL_SHUTDOWN_TIMEOUT_S"]))
    assert grace >= shutdown + 5
    assert shutdown == Settings.model_fields["shutdown_timeout_s"].default
    assert any(v.endswith(":/model:ro") for v in corral["volumes"])
    assert any(v.endswith(":/var/cache/corral") for v in corral["volumes"])


def test_monitoring_profile_provisions_the_dashboard() -> None:
    services = _compose()["services"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]
    grafana = services["grafana"]
    mounts = {container: host for host, container, *_ in (v.split(":") for v in grafana["volumes"])}
    (provider,) = _docs(REPO / mounts["/etc/grafana/provisioning"] / "dashboards" / "corral.yml")[0]["providers"]
    dashboards_dir = provider["options"]["path"]
    assert (REPO / mounts[dashboards_dir] / DASHBOARD.name).resolve() == DASHBOARD
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{dashboards_dir}/{DASHBOARD.name}"
    (prometheus,) = _docs(REPO / "deploy" / "monitoring" / "prometheus.yml")
    (sd,) = prometheus["scrape_configs"][0]["dns_sd_configs"]
    assert sd["names"] == ["corral"] and sd["port"] == 8000
