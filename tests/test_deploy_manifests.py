"""deploy/k8s and the Dockerfile, checked without a cluster: every kustomization renders
(its resources loaded with PyYAML, the namespace applied, as `kubectl kustomize` does for
these plain files) and every manifest validates against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail). The probes and preStop hooks are checked
against the routes the apps really have (the server's are also requested on a live replica
in tests/test_gateway_under_load.py), and the gateway's Redis and replicas wire up."""

from __future__ import annotations

import os
import re
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml

from kvserve.gateway.app import build_app
from kvserve.gateway.config import parse_config
from kvserve.routing.probe_deadline import PROBE_DEADLINE_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "k8s")
KUBERNETES = "1.33.0"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
SERVER_PROBES = {"/health", "/health/ready"}  # kvserve/entrypoints/openai/api_server.py


def render(directory: str) -> list[dict]:
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    assert set(kust) <= {"apiVersion", "kind", "namespace", "resources"}, "a feature this renderer lacks"
    docs = []
    for name in kust["resources"]:
        with open(os.path.join(directory, name)) as f:
            for doc in yaml.safe_load_all(f):
                if doc is None:
                    continue
                if "namespace" in kust and doc["kind"] not in CLUSTER_SCOPED:
                    doc.setdefault("metadata", {})["namespace"] = kust["namespace"]
                docs.append(doc)
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module")
def server():
    return render(os.path.join(K8S, "kvserve"))


@pytest.fixture(scope="module")
def gateway():
    return render(os.path.join(K8S, "kvserve-gateway"))


def gateway_config(gateway: list[dict]) -> dict:
    cm = next(d for d in by_kind(gateway, "ConfigMap") if d["metadata"]["name"] == "kvserve-gateway-config")
    return yaml.safe_load(cm["data"]["gateway.yaml"])


def test_every_manifest_renders_and_validates(server, gateway):
    listed = set()
    for name in ("kvserve", "kvserve-gateway"):
        with open(os.path.join(K8S, name, "kustomization.yaml")) as f:
            listed |= {os.path.join(name, r) for r in yaml.safe_load(f)["resources"]}
    shipped = {
        os.path.relpath(os.path.join(d, f), K8S)
        for d, _, files in os.walk(K8S) for f in files if f.endswith(".yaml") and f != "kustomization.yaml"
    }  # fmt: skip
    assert shipped == listed, "a manifest outside every kustomization would go unvalidated"
    kinds = {d["kind"] for d in server + gateway}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds
    for doc in server + gateway:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises on any schema error


def test_validation_catches_a_broken_manifest(server):
    for breakage in ("misspelled", "wrong type"):
        dep = yaml.safe_load(yaml.safe_dump(by_kind(server, "Deployment")[0]))
        c = _containers(dep)[0]
        if breakage == "misspelled":
            c["readinesProbe"] = c.pop("readinessProbe")
        else:
            c["readinessProbe"]["periodSeconds"] = "often"
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(dep, KUBERNETES, strict=True)


def _containers(dep: dict) -> list[dict]:
    return dep["spec"]["template"]["spec"]["containers"]


def _probe_paths(dep: dict) -> dict[str, str]:
    c = _containers(dep)[0]
    return {k: c[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}


def _check_lifecycle(dep: dict, shutdown_timeout: float, liveness: str = "/health") -> None:
    c = _containers(dep)[0]
    ports = {p["name"] for p in c["ports"]}
    for k in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[k]["httpGet"]["port"] in ports
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pause = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pause + shutdown_timeout, "SIGKILL would come before the drain's deadline"
    paths = _probe_paths(dep)
    assert paths["readinessProbe"] == "/health/ready" and paths["livenessProbe"] == liveness


def test_server_probes_prestop_and_hpa(server):
    dep = by_kind(server, "Deployment")[0]
    args = _containers(dep)[0]["args"]
    assert args[0] == "serve"
    _check_lifecycle(dep, float(args[args.index("--shutdown-timeout") + 1]))
    assert set(_probe_paths(dep).values()) <= SERVER_PROBES
    c = _containers(dep)[0]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    hpa = by_kind(server, "HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] >= 1  # never to zero: a replica loads for minutes
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(by_kind(server, "ConfigMap")[0]["data"]["config.yaml"])["rules"]
    assert any(r["name"]["as"] == metric and "kvserve:saturation" in r["seriesQuery"] for r in rules)
    pdb = by_kind(server, "PodDisruptionBudget")[0]
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_services_select_their_pods(server, gateway):
    for docs in (server, gateway):
        workloads = by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
        pods = [d["spec"]["template"]["metadata"]["labels"] for d in workloads]
        for svc in by_kind(docs, "Service"):
            sel = svc["spec"]["selector"]
            matches = [p for p in pods if sel.items() <= p.items()]
            assert len(matches) == 1, svc["metadata"]["name"]


def test_gateway_replicas_share_redis_and_reach_the_servers(server, gateway, monkeypatch, tmp_path):
    cfg_doc = gateway_config(gateway)
    for var in re.findall(r"env:(\w+)", yaml.safe_dump(cfg_doc)):
        monkeypatch.setenv(var, f"sk-test-{var.lower()}")  # distinct: a key may not be the master key
    cfg = parse_config(cfg_doc)  # the gateway's own validation
    gw = next(d for d in by_kind(gateway, "Deployment") if d["metadata"]["name"] == "kvserve-gateway")
    assert gw["spec"]["replicas"] >= 2
    redis = urlparse(cfg.general_settings.state)
    svc = {d["metadata"]["name"]: d for d in by_kind(gateway, "Service")}
    assert redis.scheme == "redis" and redis.hostname in svc
    assert redis.port == svc[redis.hostname]["spec"]["ports"][0]["port"]
    _check_redis(gateway, svc, redis.hostname, cfg.response_cache.store)
    backend = urlparse(cfg.model_list[0].backend.base_url)
    kvserve_svc = by_kind(server, "Service")[0]
    name, ns = kvserve_svc["metadata"]["name"], kvserve_svc["metadata"]["namespace"]
    assert backend.hostname in (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local")
    assert backend.port == kvserve_svc["spec"]["ports"][0]["port"]
    args = _containers(gw)[0]["args"]
    mount = next(m for m in _containers(gw)[0]["volumeMounts"] if m["name"] == "config")["mountPath"]
    assert args[0] == "gateway" and args[args.index("--config") + 1] == f"{mount}/gateway.yaml"
    # (the gateway's /health with a key is LiteLLM's model health: probes use the key-free path)
    _check_lifecycle(gw, cfg.general_settings.shutdown_timeout, "/health/liveliness")
    # the probe paths are routes of the real gateway app built from this config
    cfg.general_settings.state = "memory"
    cfg.general_settings.database = str(tmp_path / "gw.db")
    routes = {getattr(r, "path", None) for r in build_app(cfg, web_ui=False).routes}
    assert set(_probe_paths(gw).values()) <= routes
    # /health/ready answers within its deadline (routing/probe_deadline.py): the probe must wait longer
    assert _containers(gw)[0]["readinessProbe"].get("timeoutSeconds", 1) >= 2 * PROBE_DEADLINE_S


def _redis_behind(docs: list[dict], service: dict) -> tuple[dict, dict]:
    """The workload a Service selects, and its redis-server flags as a dict."""
    sel = service["spec"]["selector"]
    workloads = by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet")
    w = next(d for d in workloads if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items())
    args = _containers(w)[0]["args"]
    return w, dict(zip(args[::2], args[1::2]))


def _check_redis(docs: list[dict], services: dict, state_host: str, cache_url: str | None) -> None:
    """The state store's Redis persists (append-only file on a claimed volume: a restart kept no
    budget spend) and never evicts (a dropped window resets a rate limit); the response cache
    has a Redis of its own with a memory cap (its answers evicted the state store's windows)."""
    state, flags = _redis_behind(docs, services[state_host])
    assert state["kind"] == "StatefulSet" and flags["--appendonly"] == "yes"
    mount = next(m for m in _containers(state)[0]["volumeMounts"] if m["mountPath"] == flags["--dir"])
    claims = {c["metadata"]["name"] for c in state["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    assert flags["--maxmemory-policy"] == "noeviction"
    cache = urlparse(cache_url or "")
    assert cache.scheme == "redis" and cache.hostname in services and cache.hostname != state_host
    assert cache.port == services[cache.hostname]["spec"]["ports"][0]["port"]
    _, flags = _redis_behind(docs, services[cache.hostname])
    assert flags["--maxmemory"] and flags["--maxmemory-policy"].startswith("allkeys-")


def test_dockerfile_cpu_image():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert re.match(r"FROM python:3\.\d+-slim-(bookworm|trixie)$", lines[0])  # Debian Python base
    torch = next(i for i, ln in enumerate(lines) if "torch==2.13.0" in ln)
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch]
    project = next(i for i, ln in enumerate(lines) if re.search(r"pip install .*\s\.(\s|$)", ln))
    assert torch < project, "torch must come from the CPU index before the project's dependencies"
    assert 'ENTRYPOINT ["kvserve"]' in lines
    both = render(os.path.join(K8S, "kvserve")) + render(os.path.join(K8S, "kvserve-gateway"))
    images = {c["image"] for d in by_kind(both, "Deployment") for c in _containers(d) if c["name"] != "redis"}
    assert images == {"kvserve:0.1.0-cpu"}


def test_the_documented_setup_creates_every_secret_the_manifests_read(server, gateway):
    """DEPLOYMENT.md's commands created the gateway's secret only: the servers' (their
    --api-key, an optional reference) was never made, so they accepted any caller in the
    cluster while the gateway sent them a key."""
    refs = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("secretKeyRef", "secretRef") and isinstance(v, dict):
                    refs.add(v["name"])
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(server + gateway)
    with open(os.path.join(ROOT, "docs", "DEPLOYMENT.md")) as f:
        created = set(re.findall(r"create secret generic ([\w-]+)", f.read()))
    assert refs and refs <= created, refs - created
