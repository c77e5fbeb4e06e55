"""The Kubernetes manifests in deploy/, through the checks of tests/manifest_checks.py: the shipped manifests pass
every check, the parts a deployment needs are there, the executor's real Job fits them, and each kind of breakage is
caught with its message."""
from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import yaml

from tests.manifest_checks import (
    APP_IMAGE,
    DEPLOY,
    K8S_VERSIONS,
    ROOT,
    Index,
    app_errors,
    executor_permissions,
    load,
    manifest_files,
    matches,
    ns,
    reference_errors,
    schema_errors,
    settings_read,
    validate,
    workers,
)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return load(manifest_files())


def test_it_lists_every_manifest_in_the_kustomization():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    top_level = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == top_level
    assert [image["name"] for image in kustomization["images"]] == [APP_IMAGE]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_it_matches_the_kubernetes_schemas(docs, version):
    assert len(docs) >= 20
    assert schema_errors(docs, version) == []


def test_it_has_no_dangling_reference(docs):
    assert reference_errors(docs) == []


def test_it_agrees_with_the_code(docs):
    assert app_errors(docs) == []


def test_it_deploys_every_part(docs):
    index = Index(docs)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for part in [("Deployment", "lightning-web"), ("Service", "lightning-web"), ("Ingress", "lightning-web"),
                 ("Deployment", "lightning-control"), ("Deployment", "lightning-beat"), ("Job", "lightning-migrate"),
                 ("Service", "lightning-proxy"), ("Role", "lightning-harness-jobs"),
                 ("StatefulSet", "postgres"), ("StatefulSet", "redis")]:
        assert part in kinds
    beat = index.get("Deployment", "lightning", "lightning-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    gpu_workers = [(w, c) for w, c, _ in workers(index)]
    assert {pool for _, _, pool in workers(index)} == {"default", "big"}
    for workload, container in gpu_workers:
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert workload["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert executor_permissions() >= {("batch", "jobs", "create"), ("batch", "jobs", "watch"),
                                      ("batch", "jobs", "delete"), ("", "pods/log", "get")}


def test_the_executors_job_passes_the_schemas_and_the_harness_policy(docs, settings):
    """The Job the executor really sends (its job_body), in the namespace the ConfigMap names: valid for the API,
    and selected by the harness namespace's NetworkPolicy."""
    from sandbox.executors.base import Attempt
    from sandbox.executors.kubernetes import KubernetesExecutor

    index = Index(docs)
    data = index.get("ConfigMap", "lightning", "lightning-config")["data"]
    settings.LIGHTNING_PROXY_ADVERTISE_URL = "http://10.1.2.3:8100"
    executor = types.SimpleNamespace(image="python:3.11-slim", resources={"cpu": "2", "memory": "4Gi"},
                                     namespace=data["LIGHTNING_K8S_NAMESPACE"], ttl_s=3600)
    attempt = Attempt(command=["python", "agent.py", "{task_file}"], env={}, timeout_s=600, workdir=Path("/tmp/w"),
                      task_id="t1", task={"question": "2+2"}, rollout_id="41", base_url="http://0.0.0.0:8100/rollouts/41/v1",
                      api_key="k", run_id="7", step=3)
    job = KubernetesExecutor.job_body(executor, attempt, "lw-7-41-abc123")
    job["_where"] = "sandbox/executors/kubernetes.py job_body"
    for version in K8S_VERSIONS:
        assert schema_errors([job], version) == []
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["lightning/run"] == "7" and pod_labels["lightning/rollout"] == "41"
    policies = [p for p in index.of_kind("NetworkPolicy") if ns(p) == job["metadata"]["namespace"]]
    assert policies and all(matches(p["spec"]["podSelector"], pod_labels) for p in policies)
    assert any(rule_port["port"] == 8100 for p in policies for rule in p["spec"].get("egress", [])
               for rule_port in rule.get("ports", []))
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"] == "http://10.1.2.3:8100/rollouts/41/v1"


def test_the_placeholder_secrets_parse_but_the_secret_key_stops_the_start(docs, monkeypatch, tmp_path):
    """Forgetting to replace the Secret's SECRET_KEY must stop the app, not run it with a published key."""
    from lightning_web.env import EnvError, env_url, secret_key

    secret = Index(docs).get("Secret", "lightning", "lightning-secrets")["stringData"]
    for name, value in secret.items():
        monkeypatch.setenv(name, value)
    assert env_url("DATABASE_URL", ("postgres", "postgresql")) == secret["DATABASE_URL"]
    assert env_url("REDIS_URL", ("redis", "rediss")) == secret["REDIS_URL"]
    with pytest.raises(EnvError, match="use at least 32 random characters"):
        secret_key("SECRET_KEY", tmp_path)
    assert not (tmp_path / "secret_key").exists()


def test_the_deployment_doc_names_real_settings_and_files():
    """docs/deployment.md explains settings and files by name: a renamed setting or a moved file must show here."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    named = set(re.findall(r"\b(LIGHTNING_[A-Z0-9_]+)\b", text))
    assert {"LIGHTNING_K8S_NAMESPACE", "LIGHTNING_POOLS", "LIGHTNING_PROXY_ADVERTISE_URL"} <= named
    assert named - settings_read() == set()
    paths = set(re.findall(r"`((?:deploy|runs|trainer|proxy|lightning_web|tests|docs)/[\w./-]*\w)`", text))
    assert len(paths) >= 10
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


def _doc(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _container(docs, kind, name):
    return _doc(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def _drop_verb(docs):
    rule = _doc(docs, "Role", "lightning-harness-jobs")["rules"][0]
    rule["verbs"].remove("watch")


BROKEN = {
    "port as a string": (lambda d: _container(d, "Deployment", "lightning-web")["ports"][0].update(
        containerPort="8000"), "'8000' is not of type 'integer'"),
    "unknown field": (lambda d: _container(d, "Deployment", "lightning-web").update(imagePullPolicyy="Always"),
                      "'imagePullPolicyy' was unexpected"),
    "service selects nothing": (lambda d: _doc(d, "Service", "lightning-web")["spec"]["selector"].update(
        {"app.kubernetes.io/component": "webb"}), "selects no pod"),
    "deployment selector off its template": (lambda d: _doc(d, "Deployment", "lightning-control")["spec"][
        "selector"]["matchLabels"].update({"app.kubernetes.io/component": "controller"}),
        "does not select its own pod template"),
    "binding to a missing role": (lambda d: _doc(d, "RoleBinding", "lightning-worker-harness-jobs")["roleRef"].update(
        name="lightning-harness-job"), "roleRef names Role 'lightning-harness-job'"),
    "role without watch": (_drop_verb, "may not watch batch/jobs"),
    "setting typo": (lambda d: _doc(d, "ConfigMap", "lightning-config")["data"].update(
        LIGHTNING_HEARTBEAT_EVRY_S="10"), "sets LIGHTNING_HEARTBEAT_EVRY_S, which no code reads"),
    "pool without a worker": (lambda d: _doc(d, "ConfigMap", "lightning-config")["data"].update(
        LIGHTNING_POOLS="default,big,a100"), "pool 'a100' of LIGHTNING_POOLS has no worker"),
    "secret key that is not there": (lambda d: _doc(d, "StatefulSet", "redis")["spec"]["template"]["spec"][
        "containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].update(key="PASSWORD"),
        "reads key 'PASSWORD' of Secret 'lightning-trial-passwords'"),
    "mount of no volume": (lambda d: _container(d, "Deployment", "lightning-worker-big")["volumeMounts"].append(
        {"name": "cache", "mountPath": "/cache"}), "volumeMount 'cache' names no volume"),
    "advertised port is not the proxy's": (lambda d: _container(d, "Deployment", "lightning-worker-default")["env"][1]
                                           .update(value="http://$(POD_IP):8101"), "advertises port 8101"),
    "two device sets behind one proxy port": (lambda d: _container(d, "Deployment", "lightning-worker-big")[
        "env"].append({"name": "LIGHTNING_DEVICE_SETS", "value": "0,1;2,3"}), "cannot share the fixed port 8100"),
    "misspelt variable on a worker": (lambda d: _container(d, "Deployment", "lightning-worker-default")["env"][1]
                                      .update(name="LIGHTNING_PROXY_ADVERTISE_ULR"),
                                      "sets LIGHTNING_PROXY_ADVERTISE_ULR, which no code reads"),
    "probe host django refuses": (lambda d: _container(d, "Deployment", "lightning-web")["readinessProbe"]["httpGet"][
        "httpHeaders"][0].update(value="10.0.0.1"), "sends Host '10.0.0.1'"),
    "policy port the workers do not expose": (lambda d: _doc(d, "NetworkPolicy", "harnesses-reach-only-the-proxy")[
        "spec"]["egress"][0]["ports"][0].update(port=8200), "egress port 8200 is not a port of"),
    "object in an unknown namespace": (lambda d: _doc(d, "PersistentVolumeClaim", "lightning-data")["metadata"].update(
        namespace="lightning-prod"), "namespace 'lightning-prod' is not a Namespace"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_it_rejects_a_broken_manifest(docs, case):
    break_it, expected = BROKEN[case]
    broken = copy.deepcopy(docs)
    break_it(broken)
    errors = validate(broken)
    assert any(expected in error for error in errors), errors
