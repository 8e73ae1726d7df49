"""Offline checks of k8s/loadtest (distributed locust: master Job, worker Job),
in the style of tests/unit/test_k8s.py and with its helpers: rendered by the pinned
kubectl's kustomize, validated strictly against the Kubernetes OpenAPI schemas,
checkov-clean, and wired consistently to each other, to the server's manifests
(k8s/overlays/cpu) and to the locustfile's options and image."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loadtests import workload
from tests.unit.test_k8s import (
    ALLOWED_CHECKOV_SKIPS,
    CHECKOV,
    IMAGE_REPOSITORY,
    K8S,
    K8S_VERSIONS,
    all_containers,
    container,
    one,
    pod_spec,
    render,
    render_text,
    selects,
)

REPO = Path(__file__).resolve().parents[2]
TARGET = "loadtest"
NAMESPACE = "specdec-loadtest"
MASTER_LABELS = {"app.kubernetes.io/name": "locust", "app.kubernetes.io/component": "master"}
WORKER_LABELS = {"app.kubernetes.io/name": "locust", "app.kubernetes.io/component": "worker"}


def docs() -> list[dict]:
    return render(TARGET)


def settings(rendered: list[dict]) -> dict:
    found = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("locust-settings-")]
    assert len(found) == 1
    return found[0]["data"]


def job(rendered: list[dict], name: str) -> dict:
    return one(rendered, "Job", name)


def test_kustomize_builds():
    rendered = docs()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
    names = {(kind, re.sub(r"-[a-z0-9]{10}$", "", name)) for kind, name in kinds}
    assert names == {
        ("Namespace", NAMESPACE), ("ServiceAccount", "locust"), ("ConfigMap", "locust-settings"),
        ("ConfigMap", "locust-prompts"), ("Job", "locust-master"), ("Job", "locust-worker"),
        ("Service", "locust-master"), ("NetworkPolicy", "default-deny"), ("NetworkPolicy", "locust-master"),
        ("NetworkPolicy", "locust-worker"),
    }
    assert all(d["metadata"].get("namespace", NAMESPACE) == NAMESPACE for d in rendered)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_objects_validate_against_kubernetes_openapi(version):
    import kubernetes_validate

    errors = []
    for doc in docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {error.message}")
    assert not errors, "\n".join(errors)


def test_checkov_reports_no_failed_checks(tmp_path):
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} missing: run bash .ci/tools/install-checkov.sh (make test does)")
    (tmp_path / "loadtest.yaml").write_text(render_text(TARGET))
    proc = subprocess.run(
        [str(CHECKOV), "--directory", str(tmp_path), "--framework", "kubernetes", "--output", "json",
         "--skip-download"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode in (0, 1), f"checkov crashed:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    failed = [f"{c['check_id']} {c['check_name']} ({c['resource']})" for c in report["results"]["failed_checks"]]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert report["summary"]["passed"] > 0 and report["summary"]["parsing_errors"] == 0
    for check in report["results"]["skipped_checks"]:
        assert check["check_id"] in ALLOWED_CHECKOV_SKIPS, f"undocumented skip {check['check_id']}"
        assert len(check["check_result"].get("suppress_comment", "")) > 20


def test_pods_are_locked_down_and_bounded():
    rendered = docs()
    namespace = one(rendered, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name in ("locust-master", "locust-worker"):
        workload_job = job(rendered, name)
        assert workload_job["spec"]["activeDeadlineSeconds"] > 0, "a load test must end by itself"
        spec = pod_spec(workload_job)
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False, "service links inject LOCUST_MASTER_* variables"
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] >= 10000
        assert security["seccompProfile"]["type"] == "RuntimeDefault"
        for c in all_containers(spec):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind])
            assert c["image"].startswith(IMAGE_REPOSITORY + ":") and c["image"].endswith("-loadtest")
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, "the root filesystem is read-only: locust and matplotlib need /tmp"
    assert job(rendered, "locust-master")["spec"]["backoffLimit"] == 0, "never rerun a load test behind the user's back"


def test_workers_find_the_master_and_the_master_waits_for_them():
    rendered = docs()
    data = settings(rendered)
    master_job, worker_job = job(rendered, "locust-master"), job(rendered, "locust-worker")
    service = one(rendered, "Service", "locust-master")
    master_pod_labels = master_job["spec"]["template"]["metadata"]["labels"]
    worker_pod_labels = worker_job["spec"]["template"]["metadata"]["labels"]
    assert MASTER_LABELS.items() <= master_pod_labels.items() and WORKER_LABELS.items() <= worker_pod_labels.items()
    assert all(master_pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert not all(worker_pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"master": 5557, "web": 8089}
    master = container(pod_spec(master_job), "locust")
    assert {p["name"]: p["containerPort"] for p in master["ports"]} == ports
    assert {"--master", "--autostart"} <= set(master["args"])
    assert any(a.startswith("--csv=/reports/") for a in master["args"])
    assert any(m["mountPath"] == "/reports" for m in master["volumeMounts"])
    worker = container(pod_spec(worker_job), "locust")
    assert "--worker" in worker["args"]
    assert f"--master-host={service['metadata']['name']}" in worker["args"]
    assert f"--master-port={ports['master']}" in worker["args"]
    assert "--exit-code-on-error=0" in worker["args"], "a worker restarted after failed requests would hang around"
    expected = int(data["LOCUST_EXPECT_WORKERS"])
    assert worker_job["spec"]["parallelism"] == worker_job["spec"]["completions"] == expected
    for c in (master, worker):
        refs = [e["configMapRef"]["name"] for e in c["envFrom"]]
        assert any(r.startswith("locust-settings-") for r in refs)


def test_settings_are_options_locust_knows():
    """Every LOCUST_* in loadtest.env is a locust option or one of the locustfile's:
    a misspelt name would be silently ignored."""
    code = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from locust.argument_parser import get_parser\n"
        "import loadtests.locustfile\n"  # registers the custom options
        "parser = get_parser()\n"
        "print(json.dumps(sorted(a.env_var for a in parser._actions if getattr(a, 'env_var', None))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    known = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert {workload.env_name(flag) for flag, _ in workload.OPTIONS} <= known
    data = settings(docs())
    assert set(data) <= known, f"unknown settings: {set(data) - known}"
    # And they parse: phases, numbers, the prompt source.
    workload.build_phases(data["LOCUST_STEPS"], data["LOCUST_MODES"])
    workload.numbers(data["LOCUST_MAX_TOKENS"], int)
    workload.numbers(data["LOCUST_TEMPERATURE"], float)
    assert float(data["LOCUST_STEP_SECONDS"]) > 0


def test_the_load_reaches_the_server_of_k8s_base():
    rendered = docs()
    server = render("overlays/cpu")
    server_service = one(server, "Service", "triton-specdec")
    server_namespace = server_service["metadata"]["namespace"]
    grpc_port = next(p["port"] for p in server_service["spec"]["ports"] if p["name"] == "grpc")
    host = settings(rendered)["LOCUST_HOST"]
    assert re.fullmatch(rf"triton-specdec\.{server_namespace}(\.svc(\.cluster\.local)?)?:{grpc_port}", host), host
    # The server admits client namespaces by label; this namespace carries it.
    policy = one(server, "NetworkPolicy", "triton-specdec")
    client_selectors = [peer["namespaceSelector"] for rule in policy["spec"]["ingress"] for peer in rule["from"]
                        if "namespaceSelector" in peer]
    namespace_labels = one(rendered, "Namespace")["metadata"]["labels"]
    assert any(selects(selector, namespace_labels) for selector in client_selectors)
    # Both locust pods may reach the server's gRPC port (and the worker the master).
    server_labels = one(server, "Deployment", "triton-specdec")["spec"]["template"]["metadata"]["labels"]
    for name in ("locust-master", "locust-worker"):
        egress = one(rendered, "NetworkPolicy", name)["spec"]["egress"]
        to_server = [rule for rule in egress for peer in rule["to"]
                     if peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
                     == server_namespace and selects(peer["podSelector"], server_labels)]
        assert to_server and {p["port"] for r in to_server for p in r["ports"]} == {grpc_port}, name
    worker_egress = one(rendered, "NetworkPolicy", "locust-worker")["spec"]["egress"]
    assert any(selects(peer.get("podSelector", {"matchLabels": {"x": "y"}}), MASTER_LABELS)
               and {p["port"] for p in rule["ports"]} == {5557}
               for rule in worker_egress for peer in rule["to"])
    master_ingress = one(rendered, "NetworkPolicy", "locust-master")["spec"]["ingress"]
    assert any(selects(peer["podSelector"], WORKER_LABELS) for rule in master_ingress for peer in rule["from"])


def test_prompts_configmap_is_a_valid_prompts_file(tmp_path):
    rendered = docs()
    prompts = [d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("locust-prompts-")]
    (configmap,) = prompts
    (filename, content), = configmap["data"].items()
    path = tmp_path / filename
    path.write_text(content)
    assert workload.load_prompts(str(path))
    for name in ("locust-master", "locust-worker"):
        spec = pod_spec(job(rendered, name))
        volume = next(v for v in spec["volumes"] if v.get("configMap", {}).get("name") == configmap["metadata"]["name"])
        mount = next(m for m in container(spec, "locust")["volumeMounts"] if m["name"] == volume["name"])
        assert mount["mountPath"] == "/opt/specdec/prompts" and mount["readOnly"] is True
    chosen = settings(rendered)["LOCUST_PROMPTS_FILE"]
    assert chosen in ("", f"/opt/specdec/prompts/{filename}")
    assert f"LOCUST_PROMPTS_FILE=/opt/specdec/prompts/{filename}" in (K8S / TARGET / "kustomization.yaml").read_text()


def test_manifests_parse_as_plain_yaml():
    for path in sorted((K8S / TARGET).glob("*.yaml")):
        assert list(yaml.safe_load_all(path.read_text())), path
