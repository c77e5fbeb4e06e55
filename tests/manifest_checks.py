"""Checks of the Kubernetes manifests in deploy/: valid against the API's schemas, consistent with each other and
with the code. `validate(load(manifest_files()))` lists every error; tests/common/test_deploy_manifests.py runs it.

No cluster and no kubectl here (`kubectl apply --dry-run=client` needs an API server for discovery), so each document
is checked against the OpenAPI-derived JSON schemas that kubernetes-validate bundles (strict: unknown fields fail),
for the oldest and newest Kubernetes the manifests target, and then for what the API server or the app would refuse
at run time: selectors that select nothing, references to objects that do not exist, a Role that lacks a verb the
harness executor calls, a setting no code reads, a pool with no worker.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.30", "1.37")
"""1.30: the oldest with the pod securityContext.appArmorProfile field the workers set; 1.37: the newest bundled."""
APP_IMAGE = "lightning-web"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
OUTSIDE_NAMESPACES = {"kube-system"}
"""Namespaces the manifests may point at without creating them."""
EXECUTOR = ROOT / "sandbox" / "executors" / "kubernetes.py"
VERB_OF_METHOD = {"create": "create", "read": "get", "list": "list", "delete": "delete", "patch": "patch",
                  "replace": "update"}
RESOURCE_OF_OBJECT = {"job": ("batch", "jobs"), "pod": ("", "pods"), "pod_log": ("", "pods/log")}


# ---------------------------------------------------------------- loading


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "kustomization.yaml")


def load(paths: list[Path]) -> list[dict]:
    """Every document of the files, each with `_where` ("file#index") for messages."""
    docs = []
    for path in paths:
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                doc["_where"] = f"{path.relative_to(ROOT)}#{index}"
                docs.append(doc)
    return docs


def strip(doc: dict) -> dict:
    return {key: value for key, value in doc.items() if key != "_where"}


def ident(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')} ({doc['_where']})"


# ---------------------------------------------------------------- the validator


def schema_errors(docs: list[dict], version: str) -> list[str]:
    return [f"{ident(doc)}: {error}" for doc in docs
            if (error := schema_error(json.dumps(strip(doc), sort_keys=True), version))]


@functools.lru_cache(maxsize=None)
def schema_error(document: str, version: str) -> str:
    """The first schema error of one document (JSON text, so that an unchanged document is checked once), or ""."""
    try:
        kubernetes_validate.validate(json.loads(document), version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(str(part) for part in exc.path)}: {exc.message} (Kubernetes {version} schema)"
    except (kubernetes_validate.SchemaNotFoundError, KeyError) as exc:
        return f"no schema: {getattr(exc, 'message', exc)}"
    return ""


class Index:
    """The documents by kind, namespace and name, and the pod templates of the workloads."""

    def __init__(self, docs: list[dict]):
        self.docs = docs
        self.by_key: dict[tuple[str, str, str], dict] = {}
        for doc in docs:
            meta = doc.get("metadata", {})
            self.by_key[(doc.get("kind"), meta.get("namespace", ""), meta.get("name"))] = doc

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return self.by_key.get((kind, namespace, name))

    def of_kind(self, kind: str) -> list[dict]:
        return [doc for doc in self.docs if doc.get("kind") == kind]

    def pods(self, namespace: str) -> list[tuple[dict, dict]]:
        """(workload, pod template) of every workload in the namespace."""
        return [(doc, doc["spec"]["template"]) for doc in self.docs
                if doc.get("kind") in WORKLOADS and ns(doc) == namespace]

    def selected(self, namespace: str, selector: dict) -> list[tuple[dict, dict]]:
        return [(w, t) for w, t in self.pods(namespace) if matches(selector, t.get("metadata", {}).get("labels", {}))]


def ns(doc: dict) -> str:
    return doc.get("metadata", {}).get("namespace", "")


def matches(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels/matchExpressions, or a Service's plain map) selects `labels`."""
    plain = {k: v for k, v in selector.items() if k not in ("matchLabels", "matchExpressions")}
    wanted = {**plain, **selector.get("matchLabels", {})}
    if any(labels.get(key) != value for key, value in wanted.items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels) or \
                (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values):
            return False
    return True


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec.get("containers", [])


def port_names(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
            if "name" in p}


def port_numbers(template: dict) -> set[int]:
    return {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def reference_errors(docs: list[dict]) -> list[str]:
    """What the schemas cannot see: names, selectors and references that must agree across documents."""
    index, errors = Index(docs), []
    namespaces = {doc["metadata"]["name"] for doc in index.of_kind("Namespace")}
    seen: set[tuple] = set()
    for doc in docs:
        key = (doc.get("kind"), ns(doc), doc.get("metadata", {}).get("name"))
        if key in seen:
            errors.append(f"{ident(doc)}: a second {key[0]} named {key[2]} in namespace {key[1]!r}")
        seen.add(key)
        if doc.get("kind") not in CLUSTER_SCOPED and ns(doc) not in namespaces:
            errors.append(f"{ident(doc)}: namespace {ns(doc)!r} is not a Namespace of the manifests "
                          "(every namespaced object names one)")
    for doc in docs:
        kind = doc.get("kind")
        if kind in WORKLOADS:
            errors += workload_errors(index, doc)
        elif kind == "Service":
            errors += service_errors(index, doc)
        elif kind == "Ingress":
            errors += ingress_errors(index, doc)
        elif kind == "RoleBinding":
            errors += binding_errors(index, doc)
        elif kind == "NetworkPolicy":
            errors += network_policy_errors(index, doc, namespaces)
        elif kind == "PodDisruptionBudget" and not index.selected(ns(doc), doc["spec"]["selector"]):
            errors.append(f"{ident(doc)}: selector {doc['spec']['selector']} selects no pod of the manifests")
    return errors


def workload_errors(index: Index, doc: dict) -> list[str]:
    errors, namespace, template = [], ns(doc), doc["spec"]["template"]
    labels = template.get("metadata", {}).get("labels", {})
    selector = doc["spec"].get("selector")
    if doc["kind"] != "Job" and (selector is None or not matches(selector, labels)):
        errors.append(f"{ident(doc)}: spec.selector {selector} does not select its own pod template's labels {labels}")
    if doc["kind"] == "StatefulSet" and not index.get("Service", namespace, doc["spec"].get("serviceName")):
        errors.append(f"{ident(doc)}: serviceName {doc['spec'].get('serviceName')!r} is no Service")
    spec = template["spec"]
    account = spec.get("serviceAccountName")
    if account and account != "default" and not index.get("ServiceAccount", namespace, account):
        errors.append(f"{ident(doc)}: serviceAccountName {account!r} is no ServiceAccount in {namespace}")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    volumes.update({t["metadata"]["name"]: {} for t in doc["spec"].get("volumeClaimTemplates", [])})
    for volume in spec.get("volumes", []):
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim and not index.get("PersistentVolumeClaim", namespace, claim):
            errors.append(f"{ident(doc)}: volume {volume['name']} claims {claim!r}, no PersistentVolumeClaim")
    names = [c["name"] for c in containers(template)]
    if len(names) != len(set(names)):
        errors.append(f"{ident(doc)}: container names repeat: {names}")
    for container in containers(template):
        where = f"{ident(doc)}: container {container['name']}"
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                errors.append(f"{where}: volumeMount {mount['name']!r} names no volume")
        for source in container.get("envFrom", []):
            for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if ref in source and not source[ref].get("optional") and \
                        not index.get(kind, namespace, source[ref]["name"]):
                    errors.append(f"{where}: envFrom {kind} {source[ref]['name']!r} does not exist")
        for var in container.get("env", []):
            for kind, ref in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                ref = var.get("valueFrom", {}).get(ref)
                if ref is None or ref.get("optional"):
                    continue
                target = index.get(kind, namespace, ref["name"])
                keys = set() if target is None else set(target.get("data", {})) | set(target.get("stringData", {}))
                if ref["key"] not in keys:
                    errors.append(f"{where}: env {var['name']} reads key {ref['key']!r} of {kind} {ref['name']!r}, "
                                  "which has no such key")
        ports = [p.get("name") for p in container.get("ports", []) if p.get("name")]
        if len(ports) != len(set(ports)):
            errors.append(f"{where}: port names repeat: {ports}")
    return errors


def service_errors(index: Index, doc: dict) -> list[str]:
    selector = doc["spec"].get("selector")
    if not selector:
        return []
    pods = index.selected(ns(doc), selector)
    if not pods:
        return [f"{ident(doc)}: selector {selector} selects no pod of the manifests"]
    errors = []
    for port in doc["spec"].get("ports", []):
        target = port.get("targetPort", port["port"])
        for workload, template in pods:
            known = port_names(template) if isinstance(target, str) else port_numbers(template)
            if target not in known:
                errors.append(f"{ident(doc)}: port {port.get('name', port['port'])} targets {target!r}, which "
                              f"{ident(workload)} does not expose")
    return errors


def ingress_errors(index: Index, doc: dict) -> list[str]:
    errors = []
    backends = [path["backend"] for rule in doc["spec"].get("rules", []) for path in rule["http"]["paths"]]
    for backend in backends + ([doc["spec"]["defaultBackend"]] if "defaultBackend" in doc["spec"] else []):
        service = backend["service"]
        target = index.get("Service", ns(doc), service["name"])
        if target is None:
            errors.append(f"{ident(doc)}: backend Service {service['name']!r} does not exist")
            continue
        port = service["port"]
        ports = target["spec"]["ports"]
        if not any(p.get("name") == port.get("name") if "name" in port else p["port"] == port.get("number")
                   for p in ports):
            errors.append(f"{ident(doc)}: backend port {port} is not a port of Service {service['name']}")
    return errors


def binding_errors(index: Index, doc: dict) -> list[str]:
    errors, ref = [], doc["roleRef"]
    if ref["kind"] == "Role" and not index.get("Role", ns(doc), ref["name"]):
        errors.append(f"{ident(doc)}: roleRef names Role {ref['name']!r}, which is not in namespace {ns(doc)}")
    for subject in doc.get("subjects", []):
        if subject["kind"] == "ServiceAccount" and subject["name"] != "default" and \
                not index.get("ServiceAccount", subject.get("namespace", ns(doc)), subject["name"]):
            errors.append(f"{ident(doc)}: subject ServiceAccount {subject.get('namespace')}/{subject['name']} "
                          "does not exist")
    return errors


def network_policy_errors(index: Index, doc: dict, namespaces: set[str]) -> list[str]:
    errors, namespace = [], ns(doc)
    own = doc["spec"]["podSelector"]
    if own and not index.selected(namespace, own):
        errors.append(f"{ident(doc)}: podSelector {own} selects no pod of the manifests")
    for direction in ("ingress", "egress"):
        for rule in doc["spec"].get(direction, []):
            peers = rule.get("from" if direction == "ingress" else "to", [])
            for peer in peers:
                peer_ns = peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name",
                                                                                       namespace)
                if peer_ns not in namespaces | OUTSIDE_NAMESPACES:
                    errors.append(f"{ident(doc)}: {direction} peer namespace {peer_ns!r} is not in the manifests")
                if "podSelector" in peer and peer_ns in namespaces and not index.selected(peer_ns, peer["podSelector"]):
                    errors.append(f"{ident(doc)}: {direction} peer podSelector {peer['podSelector']} selects no pod "
                                  f"in {peer_ns}")
                # The ports of an egress rule to our own pods, or of an ingress rule, must be ports those pods expose.
                pods = (index.selected(peer_ns, peer["podSelector"]) if direction == "egress" and "podSelector" in peer
                        else index.selected(namespace, own) if direction == "ingress" else [])
                for port in rule.get("ports", []):
                    for workload, template in pods:
                        if port["port"] not in port_numbers(template) | set(port_names(template)):
                            errors.append(f"{ident(doc)}: {direction} port {port['port']} is not a port of "
                                          f"{ident(workload)}")
    return errors


# ---------------------------------------------------------------- the app's own rules


def settings_read() -> set[str]:
    """Every environment variable the code reads: the settings' env readers, os.environ look-ups, and `lw`'s."""
    names = set(re.findall(r'(?:env_\w+|data_dir|secret_key)\(\s*"([A-Z][A-Z0-9_]*)"',
                           (ROOT / "lightning_web" / "settings.py").read_text()))
    for package in ("lightning_web", "api", "catalog", "runs", "dashboard", "sandbox", "trainer", "proxy", "common"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r'os\.(?:environ\.get\(|environ\[|getenv\()\s*"([A-Z][A-Z0-9_]*)"',
                                    path.read_text()))
    for path in [ROOT / "lw", *(ROOT / "scripts").iterdir()]:
        if path.is_file():
            names |= set(re.findall(r"\$\{?(LIGHTNING_[A-Z0-9_]+)", path.read_text(errors="replace")))
    return names


def app_containers(index: Index) -> list[tuple[dict, dict]]:
    """(workload, container) of every container that runs the app's image."""
    return [(w, c) for w in index.docs if w.get("kind") in WORKLOADS for c in containers(w["spec"]["template"])
            if c["image"].split(":")[0].endswith(APP_IMAGE)]


def setting_errors(index: Index) -> list[str]:
    """Every variable an app container gets, from a ConfigMap, a Secret or its own env, is one the code reads."""
    known, errors, sources = settings_read(), [], {}
    for workload, container in app_containers(index):
        for source in container.get("envFrom", []):
            for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if ref in source:
                    sources[(kind, ns(workload), source[ref]["name"])] = True
        env = container.get("env", [])
        interpolated = {n for var in env for n in re.findall(r"\$\(([A-Z0-9_]+)\)", str(var.get("value", "")))}
        errors += [f"{ident(workload)}: container {container['name']} sets {var['name']}, which no code reads "
                   "(a typo of a setting?)" for var in env if var["name"] not in known | interpolated]
    for kind, namespace, name in sources:
        target = index.get(kind, namespace, name) or {}
        errors += [f"{ident(target)}: sets {key}, which no code reads (a typo of a setting?)"
                   for key in {**target.get("data", {}), **target.get("stringData", {})} if key not in known]
    return errors


def app_errors(docs: list[dict]) -> list[str]:
    """Settings, pools, proxy and RBAC as the code expects them."""
    index = Index(docs)
    errors = setting_errors(index)
    config = index.get("ConfigMap", "lightning", "lightning-config")
    if config is None:
        return errors + ["no ConfigMap lightning/lightning-config"]
    data = config.get("data", {})
    errors += pool_errors(index, data) + proxy_errors(index, data) + rbac_errors(index, data)
    errors += probe_errors(index, data)
    return errors


def worker_pool(container: dict) -> str | None:
    """The pool a container's `lw worker --pool NAME` (or `manage.py worker --pool NAME`) serves."""
    argv = container.get("command", []) + container.get("args", [])
    if "worker" in argv and "--pool" in argv and not any(a.endswith("celery") or a == "celery" for a in argv):
        return argv[argv.index("--pool") + 1]
    return None


def workers(index: Index) -> list[tuple[dict, dict, str]]:
    return [(w, c, worker_pool(c)) for w in index.docs if w.get("kind") in WORKLOADS
            for c in w["spec"]["template"]["spec"]["containers"] if worker_pool(c)]


def pool_errors(index: Index, data: dict) -> list[str]:
    pools = ["default"] + [p.strip() for p in data.get("LIGHTNING_POOLS", "").split(",") if p.strip()]
    served = {pool for _, _, pool in workers(index)}
    errors = [f"pool {pool!r} of LIGHTNING_POOLS has no worker Deployment (`lw worker --pool {pool}`)"
              for pool in dict.fromkeys(pools) if pool not in served]
    errors += [f"{ident(w)} serves pool {pool!r}, which is not in LIGHTNING_POOLS" for w, _, pool in workers(index)
               if pool not in pools]
    return errors


def proxy_errors(index: Index, data: dict) -> list[str]:
    """Harness pods reach the proxy of the worker holding their run: every worker pod listens on all addresses at
    the port it advertises, exposes that port, and holds one device set (a second run would need a second port)."""
    errors = []
    if any(w["kind"] in WORKLOADS for w, _, _ in workers(index)) and data.get("LIGHTNING_PROXY_HOST") != "0.0.0.0":
        errors.append("LIGHTNING_PROXY_HOST must be 0.0.0.0 for harness pods to reach the proxy")
    port = int(data.get("LIGHTNING_PROXY_PORT", "0"))
    for workload, container, _ in workers(index):
        env = {v["name"]: v.get("value", "") for v in container.get("env", [])}
        advertise = env.get("LIGHTNING_PROXY_ADVERTISE_URL") or data.get("LIGHTNING_PROXY_ADVERTISE_URL", "")
        if not advertise:
            errors.append(f"{ident(workload)}: no LIGHTNING_PROXY_ADVERTISE_URL: harness pods cannot reach its proxy")
            continue
        advertised = urlsplit(advertise.replace("$(", "").replace(")", "")).port
        if port and advertised != port:
            errors.append(f"{ident(workload)}: advertises port {advertised}, but the proxy listens on {port}")
        if port and port not in {p["containerPort"] for p in container.get("ports", [])}:
            errors.append(f"{ident(workload)}: the proxy port {port} is not a container port")
        sets = env.get("LIGHTNING_DEVICE_SETS", data.get("LIGHTNING_DEVICE_SETS", ""))
        if port and ";" in sets:
            errors.append(f"{ident(workload)}: LIGHTNING_DEVICE_SETS={sets!r} runs several runs in one pod, whose "
                          f"proxies cannot share the fixed port {port}")
    return errors


def executor_permissions() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every Kubernetes call in the harness executor."""
    source = EXECUTOR.read_text()
    needed = set()
    for method, obj in re.findall(r"self\.(?:batch|core)\.(\w+?)_namespaced_(\w+)", source):
        needed.add((*RESOURCE_OF_OBJECT[obj], VERB_OF_METHOD[method]))
    for obj in re.findall(r"watch\.Watch\(\)\.stream\(\s*self\.(?:batch|core)\.list_namespaced_(\w+)", source):
        needed.add((*RESOURCE_OF_OBJECT[obj], "watch"))
    return needed


def rbac_errors(index: Index, data: dict) -> list[str]:
    namespace = data.get("LIGHTNING_K8S_NAMESPACE", "default")
    worker_accounts = {(ns(w), w["spec"]["template"]["spec"].get("serviceAccountName", "default"))
                       for w, _, _ in workers(index)}
    granted: dict[tuple[str, str], set] = {}
    for binding in index.of_kind("RoleBinding"):
        role = index.get("Role", ns(binding), binding["roleRef"]["name"])
        if ns(binding) != namespace or role is None:
            continue
        for subject in binding.get("subjects", []):
            account = (subject.get("namespace", ns(binding)), subject["name"])
            for rule in role["rules"]:
                for group in rule.get("apiGroups", []):
                    for resource in rule.get("resources", []):
                        granted.setdefault(account, set()).update((group, resource, v) for v in rule["verbs"])
    errors = []
    for account in sorted(worker_accounts):
        missing = executor_permissions() - granted.get(account, set())
        if missing:
            rights = ", ".join(f"{v} {g + '/' if g else ''}{r}" for g, r, v in sorted(missing))
            errors.append(f"ServiceAccount {account[0]}/{account[1]} of the workers may not {rights} in "
                          f"namespace {namespace} (LIGHTNING_K8S_NAMESPACE), as the harness executor does")
        wild = {(g, r, v) for g, r, v in granted.get(account, set()) if "*" in (g, r, v)}
        if wild:
            errors.append(f"ServiceAccount {account[0]}/{account[1]} holds wildcard rights {sorted(wild)}")
    return errors


def probe_errors(index: Index, data: dict) -> list[str]:
    """An HTTP probe must send a Host that Django allows, or every answer is a 400 and the pod never gets ready."""
    allowed, errors = [h.strip() for h in data.get("ALLOWED_HOSTS", "").split(",")], []
    for workload in [d for d in index.docs if d.get("kind") in WORKLOADS]:
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                http = container.get(probe, {}).get("httpGet")
                if http is None:
                    continue
                host = {h["name"].lower(): h["value"] for h in http.get("httpHeaders", [])}.get("host")
                if host not in allowed:
                    errors.append(f"{ident(workload)}: {probe} sends Host {host!r}, not in ALLOWED_HOSTS {allowed}")
    return errors


def validate(docs: list[dict]) -> list[str]:
    errors = []
    for version in K8S_VERSIONS:
        errors += schema_errors(docs, version)
    return errors + reference_errors(docs) + app_errors(docs)
