"""Kubernetes manifests from a cluster YAML (`pdserve render k8s`, deploy/render_cli.py).

For a cluster named N (``kubernetes.name``, default ``pdserve-<config file stem>``)::

    ConfigMap    N-config             the cluster YAML, rewritten for pods (below)
    Service      N-prefill-headless   headless: one DNS address per ready prefill pod
    Service      N-decode-headless    (N-colocated-headless for a colocated cluster)
    StatefulSet  N-<instance>         one per named instance, 1 replica, pod N-<instance>-0
    Deployment   N-router             the routers (stateless), router.replicas of them
    Service      N-router             the OpenAI endpoint, port router.port
    PodDisruptionBudget N-<role>      a node drain evicts one pod of a role at a time
    NetworkPolicy N-<role>            (kubernetes.network_policy) who may reach a role's pods

and with ``planner.mode`` other than off (deploy/planner.py)::

    Service      N-router-headless    one DNS address per ready router pod: the planner reads each
    Deployment   N-planner            the planner, one replica
    ServiceAccount, Role, RoleBinding N-planner
                                      (planner.mode act, orchestrator kubernetes) get and patch on
                                      statefulsets/scale of this cluster's prefill and decode
                                      StatefulSets, by name, and nothing else; every other pod
                                      mounts no service account token

Every pod runs as user 10001 (deploy/Dockerfile's), with a read-only root
file system (a writable emptyDir at /tmp, also HOME), no privilege escalation,
no capabilities and the runtime's seccomp profile; each container's memory
limit is its request. The NetworkPolicy of the prefill and decode pods lets
any pod of this cluster in on any port (with NIXL, UCX listens on ports it
picks itself, so a policy naming the declared KV ports would cut transfers)
and anyone else only on the HTTP port (Prometheus; every route but /health
and /metrics wants the internal secret); the KV ports and UCX's listeners,
the unauthenticated data plane, are thereby closed to everything outside the
cluster. The router's lets anyone in on its port (the OpenAI endpoint).

A tensor-parallel instance (``tensor_parallel_size`` N) is one pod too: its
server is rank 0 and starts ranks 1..N-1 in the same container, so the pod
requests N times ``num_threads`` CPUs and, on CUDA, ``nvidia.com/gpu: N``. A
TP group larger than one node would need a pod per node placed together and
started as one unit (the LeaderWorkerSet API: a leader pod, rank 0, and
worker pods that are restarted with it); pdserve's ranks are child processes
of rank 0, so that is not rendered, and it is not claimed to run.

A named instance is one pod, and a role's replicas are its named instances:
instances of one role may differ (ports, block size, layout, device), and each
needs a name of its own (its NIXL agent name and ZeroMQ identity; two live
processes with one name would collide at every peer). A StatefulSet, not a
Deployment, because it guarantees at most one pod per name at any time (a
Deployment's rolling update runs old and new pod side by side) and gives that
pod a stable DNS name, ``N-<instance>-0.N-<role>-headless.<ns>.svc.<domain>``,
which survives restarts. That name is the instance's ``host`` in the pods'
cluster YAML: the server binds it (the pod's /etc/hosts maps it to the pod IP),
advertises it in reservations and handshakes, and a replacement pod answers
at the same name. Add a role replica by naming one more instance, re-render
and apply; the router's ``discovery`` (kind ``dns``, names = the headless
Services) sees the new pod once it is ready.

The pods' cluster YAML is the user's, with only these keys changed: every
instance's ``host`` (above), ``router.host: 0.0.0.0`` (the router Service
reaches it), ``security.internal_secret_file`` and ``router.api_keys_file``
pointing into the mounted Secret (the values never appear in a manifest),
``model_cache`` (the image's prebuilt models, see deploy/Dockerfile) and
``discovery``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from deploy.config import ClusterConfig, ConfigError, Instance, TenantConfig, load_config, parse_config
from deploy.k8s_config import KubernetesConfig
from deploy.version import version
from engine.models import is_builtin

CONFIG_DIR = "/etc/pdserve/config"
CONFIG_FILE = f"{CONFIG_DIR}/cluster.yaml"
SECRET_DIR = "/etc/pdserve/secrets"
SECRET_KEY_INTERNAL = "internal-secret"  # keys of the Secret the user creates
SECRET_KEY_API = "api-keys"  # one API key per line
MODEL_CACHE = "/opt/pdserve/models"  # where deploy/Dockerfile prebuilds the built-in models
GRACE_MARGIN_S = 10  # terminationGracePeriodSeconds = preStop + drain timeout + this
STARTUP_BUDGET_S = 900  # a server may take this long to load (or build) its model before liveness counts
PROBE_PATH = "/health"
# The router's /health answers 503 while no decode server is healthy: a reason to take it
# out of its Service (readiness), not to restart it (liveness).
LIVENESS_PATH_ROUTER = "/metrics"
# Pods keep their own PID and IPC namespaces, so UCX's shared-memory, CMA and CUDA IPC
# transports cannot reach a peer pod even on the same node (transfer/nixl_backend.py's
# "auto" assumes one host): NIXL pods get transports that cross pods.
UCX_TLS_CPU = "tcp"
UCX_TLS_CUDA = "^sm,cma,cuda_ipc"  # UCX's choice (rc, cuda_copy, tcp, ...) minus those
SUBCOMMAND = {"prefill": "prefill", "decode": "decode", "colocated": "decode"}  # `pdserve <sub>` per role
RUN_AS = 10001  # deploy/Dockerfile's user


@dataclass(frozen=True)
class Rendered:
    name: str
    namespace: str
    secret_name: str
    secret_keys: tuple[str, ...]  # what the user's Secret must hold
    objects: list[dict]  # in apply order


def cluster_name(config_path: Path, k8s: KubernetesConfig) -> str:
    if k8s.name:
        return k8s.name
    stem = "".join(c if c.isalnum() else "-" for c in config_path.stem.lower()).strip("-")
    return f"pdserve-{stem}"[:40].rstrip("-")


def render(
    config_path: Path, name: str | None = None, namespace: str | None = None, image: str | None = None
) -> Rendered:
    """Every object for the cluster YAML at ``config_path``; the arguments override ``kubernetes:``."""
    cluster = load_config(config_path)  # the loader's messages for a bad file
    raw = yaml.safe_load(Path(config_path).read_text())
    updates = {k: v for k, v in (("name", name), ("namespace", namespace), ("image", image)) if v}
    try:
        k8s = KubernetesConfig.model_validate(
            {"image": f"pdserve:{version()}", **cluster.kubernetes.model_dump(exclude_unset=True), **updates}
        )
    except ValidationError as exc:
        (err,) = exc.errors()[:1]
        raise ConfigError(f"--{err['loc'][0]} {err['input']!r}: {err['msg']}") from None
    names = _Names(cluster_name(Path(config_path), k8s), k8s)
    for inst in cluster.instances():
        names.check(inst)
    objects_names = [names.statefulset(i) for i in cluster.instances()]
    clash = sorted({n for n in objects_names if objects_names.count(n) > 1})
    if clash:
        raise ValueError(
            f"{config_path}: instance names that differ only in case, '_' or '.' give one "
            f"Kubernetes object name: {clash}; rename them"
        )
    if not is_builtin(cluster.model) and not Path(cluster.model).is_absolute():
        raise ValueError(
            f"{config_path}: model {cluster.model!r}: on Kubernetes a model folder must be an "
            "absolute path (inside the image, or on kubernetes.model_pvc)"
        )
    pod_yaml = pod_cluster_yaml(raw, cluster, names)
    pod_data = yaml.safe_load(pod_yaml)
    parse_config(pod_data, f"{config_path} (rendered for pods)")  # it must load as is
    keys = (
        SECRET_KEY_INTERNAL,
        *((SECRET_KEY_API,) if _has_api_keys(cluster) else ()),
        *(tenant_secret_key(t.name) for t in _tenants_with_keys(cluster)),
    )
    pods = _PodParts(cluster, k8s, names, keys, pod_data)
    objects = [
        names.meta_object("v1", "ConfigMap", names.config_map, names.labels("config"), data={"cluster.yaml": pod_yaml})
    ]
    objects += [_headless_service(names, role, insts) for role, insts in _roles(cluster).items()]
    objects += [_statefulset(pods, role, inst) for role, insts in _roles(cluster).items() for inst in insts]
    objects += [_router_deployment(pods), _router_service(cluster, k8s, names)]
    if cluster.planner.mode != "off":
        objects += _planner_objects(pods)
    objects += [_disruption_budget(names, role) for role in [*_roles(cluster), "router"]]
    if k8s.network_policy:
        objects += [_network_policy(names, role, [i.port for i in insts]) for role, insts in _roles(cluster).items()]
        objects.append(_network_policy(names, "router", [cluster.router.port], open_to_all=True))
    return Rendered(names.cluster, k8s.namespace, names.secret, keys, objects)


class _Names:
    """Every object name and label set, so that selectors and DNS names agree by construction."""

    def __init__(self, cluster: str, k8s: KubernetesConfig) -> None:
        self.cluster = cluster
        self.k8s = k8s
        self.config_map = f"{cluster}-config"
        self.router = f"{cluster}-router"
        self.secret = k8s.secret_name or f"{cluster}-secrets"

    def headless(self, role: str) -> str:
        return f"{self.cluster}-{role}-headless"

    def statefulset(self, inst: Instance) -> str:
        return f"{self.cluster}-{inst.name.lower().replace('_', '-').replace('.', '-')}"

    def pod_fqdn(self, role: str, inst: Instance) -> str:
        return f"{self.statefulset(inst)}-0.{self.headless(role)}.{self.k8s.namespace}.svc.{self.k8s.cluster_domain}"

    def check(self, inst: Instance) -> None:
        if not (inst.name[0].isalnum() and inst.name[-1].isalnum() and len(inst.name) <= 63):
            raise ValueError(
                f"instance {inst.name!r}: on Kubernetes (a label value) a name must start and end "
                "with a letter or digit and be at most 63 characters"
            )
        sts = self.statefulset(inst)
        # the pod name (sts-0) and the controller-revision-hash label (sts-<10 chars>) must stay DNS labels
        if len(sts) > 52 or not sts[-1].isalnum():
            raise ValueError(
                f"instance {inst.name!r}: object name {sts!r} must be at most 52 characters and end "
                "in a letter or digit (shorten kubernetes.name or the instance name)"
            )

    def selector(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "pdserve",
            "app.kubernetes.io/instance": self.cluster,
            "app.kubernetes.io/component": component,
        }

    def labels(self, component: str, instance: str | None = None) -> dict[str, str]:
        extra = {"pdserve.io/instance": instance} if instance else {}
        return {**self.selector(component), **extra, "app.kubernetes.io/part-of": "pdserve"}

    def meta_object(self, api: str, kind: str, name: str, labels: dict, **fields: object) -> dict:
        return {
            "apiVersion": api,
            "kind": kind,
            "metadata": {"name": name, "namespace": self.k8s.namespace, "labels": labels},
            **fields,
        }


def _roles(cluster: ClusterConfig) -> dict[str, list[Instance]]:
    roles = {"prefill": cluster.prefill, "decode": cluster.decode, "colocated": cluster.colocated}
    return {role: insts for role, insts in roles.items() if insts}


def _has_api_keys(cluster: ClusterConfig) -> bool:
    return bool(cluster.router.api_keys) or cluster.router.api_keys_file is not None


def tenant_secret_key(tenant: str) -> str:
    """The Secret's key holding one tenant's API keys, one per line."""
    return f"tenant-{tenant}-keys"


def _tenants_with_keys(cluster: ClusterConfig) -> list[TenantConfig]:
    return [t for t in cluster.router.tenants if t.keys or t.keys_file is not None]


def pod_cluster_yaml(raw: dict, cluster: ClusterConfig, names: _Names) -> str:
    """The user's cluster YAML with the keys that differ in a pod (see the module docstring)."""
    data = copy.deepcopy(raw)
    security = {
        k: v for k, v in (data.get("security") or {}).items() if k not in ("internal_secret", "internal_secret_file")
    }
    data["security"] = {**security, "internal_secret_file": f"{SECRET_DIR}/{SECRET_KEY_INTERNAL}"}
    router = {k: v for k, v in (data.get("router") or {}).items() if k not in ("api_keys", "api_keys_file")}
    if _has_api_keys(cluster):
        router["api_keys_file"] = f"{SECRET_DIR}/{SECRET_KEY_API}"
    if router.get("tenants"):  # each tenant's keys from its own key of the Secret
        with_keys = {t.name for t in _tenants_with_keys(cluster)}
        router["tenants"] = [
            {k: v for k, v in t.items() if k not in ("keys", "keys_file")}
            | ({"keys_file": f"{SECRET_DIR}/{tenant_secret_key(t['name'])}"} if t["name"] in with_keys else {})
            for t in router["tenants"]
        ]
    data["router"] = {**router, "host": "0.0.0.0"}
    for role, insts in _roles(cluster).items():
        by_name = {i.name: i for i in insts}
        # Bound on every interface of the pod, reached (and advertised) at its stable DNS name.
        data[role] = [
            {**entry, "host": names.pod_fqdn(role, by_name[entry["name"]]), "bind_host": "0.0.0.0"}
            for entry in data[role]
        ]
    data["model_cache"] = MODEL_CACHE
    if cluster.planner.mode != "off":  # the planner reads every router pod, in the pods' namespace
        planner = data.get("planner") or {}
        data["planner"] = {**planner, "routers": f"{names.router}-headless:{cluster.router.port}"}
        data["planner"]["namespace"] = names.k8s.namespace
    # HOST:PORT: a headless Service gives addresses, the port is the one each instance of the role serves on.
    data["discovery"] = {
        "kind": "dns",
        "names": [
            f"{names.headless(role)}:{port}"
            for role, insts in _roles(cluster).items()
            for port in sorted({i.port for i in insts})
        ],
        "interval_s": cluster.discovery.interval_s,
    }
    header = (
        f"# {names.cluster}: rendered by `pdserve render k8s` for its pods (see deploy/k8s.py).\n"
        "# Secrets are read from the mounted Secret; no value is written here.\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False)


@dataclass(frozen=True)
class _PodParts:
    cluster: ClusterConfig
    k8s: KubernetesConfig
    names: _Names
    secret_keys: tuple[str, ...]
    pod_data: dict  # the pods' cluster YAML, loaded

    def config_digest(self, instance: str | None) -> str:
        """A pod annotation that changes when what this pod reads changes, so that
        `kubectl apply` restarts it then, and only then: a server reads the
        cluster-wide keys and its own entry (adding an instance restarts no
        running server); the router reads everything."""
        data = self.pod_data
        if instance is not None:
            data = {k: v for k, v in data.items() if k not in SUBCOMMAND and k != "discovery"}  # the router's
            data["self"] = [e for role in SUBCOMMAND for e in self.pod_data.get(role, []) if e["name"] == instance]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def grace_s(self) -> int:
        return self.k8s.prestop_s + math.ceil(self.cluster.drain_timeout_s) + GRACE_MARGIN_S

    def volumes(self) -> list[dict]:
        vols = [
            {"name": "config", "configMap": {"name": self.names.config_map}},
            {"name": "tmp", "emptyDir": {}},  # the one writable place: the root file system is read-only
            {
                "name": "secrets",
                "secret": {
                    "secretName": self.names.secret,
                    "defaultMode": 0o400,
                    "items": [{"key": k, "path": k} for k in self.secret_keys],
                },
            },
        ]
        if self.k8s.model_pvc:
            vols.append({"name": "model", "persistentVolumeClaim": {"claimName": self.k8s.model_pvc, "readOnly": True}})
        return vols

    def mounts(self) -> list[dict]:
        mounts: list[dict] = [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True},
        ]
        if self.k8s.model_pvc:
            mounts.append({"name": "model", "mountPath": self.cluster.model, "readOnly": True})
        return mounts

    def container(
        self,
        name: str,
        command: list[str],
        ports: dict[str, int],
        resources: dict,
        liveness_path: str,
        env: dict[str, str],
    ) -> dict:
        env = {"PYTHONUNBUFFERED": "1", "HOME": "/tmp", **env}  # caches (Hugging Face, torch) under HOME
        return {
            "name": name,
            "image": self.k8s.image,
            "imagePullPolicy": self.k8s.image_pull_policy,
            "command": command,
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "ports": [
                {"name": port_name, "containerPort": port, "protocol": "TCP"} for port_name, port in ports.items()
            ],
            "resources": resources,
            # loading (or building) the model may take minutes: liveness counts only after this passes
            "startupProbe": _probe(PROBE_PATH, period=5, failures=STARTUP_BUDGET_S // 5),
            "readinessProbe": _probe(PROBE_PATH, period=5, failures=2),
            "livenessProbe": _probe(liveness_path, period=10, failures=3),
            # The server drains on SIGTERM (server_common/run.py); the sleep first lets the
            # router's discovery and the Service drop this pod, so new work goes elsewhere.
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(self.k8s.prestop_s)]}}},
            "volumeMounts": self.mounts(),
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
        }

    def template(self, labels: dict, http_port: int, container: dict, instance: str | None) -> dict:
        annotations = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(http_port),
            "prometheus.io/path": "/metrics",
            "pdserve.io/config-sha256": self.config_digest(instance),
        }
        spec = {
            "terminationGracePeriodSeconds": self.grace_s,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS,
                "runAsGroup": RUN_AS,
                "fsGroup": RUN_AS,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": self.volumes(),
        }
        if instance is not None:  # a server pod: the hooks that place it (GPU nodes)
            if self.k8s.node_selector:
                spec["nodeSelector"] = dict(self.k8s.node_selector)
            if self.k8s.tolerations:
                spec["tolerations"] = list(self.k8s.tolerations)
        return {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}


def _probe(path: str, period: int, failures: int) -> dict:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _headless_service(names: _Names, role: str, insts: list[Instance]) -> dict:
    first = insts[0]
    spec = {
        "clusterIP": "None",
        "selector": names.selector(role),
        "publishNotReadyAddresses": False,
        # named target ports: each pod's own port, so its SRV record (_http._tcp.NAME) carries it
        "ports": [
            {"name": "http", "port": first.port, "targetPort": "http", "protocol": "TCP"},
            {"name": "kv", "port": first.transfer_port, "targetPort": "kv", "protocol": "TCP"},
        ],
    }
    return names.meta_object("v1", "Service", names.headless(role), names.labels(role), spec=spec)


def _statefulset(pods: _PodParts, role: str, inst: Instance) -> dict:
    cluster, names = pods.cluster, pods.names
    # as ServerSettings would pick them (deploy/config.py), without reading the secret file it names
    threads = inst.num_threads or cluster.engine.num_threads or 1
    device = inst.device or cluster.engine.device or cluster.device
    # A tensor-parallel instance is one pod: its server process is rank 0 and starts the other ranks
    # inside the same container, each with num_threads threads (and one GPU on CUDA).
    ranks = cluster.tensor_parallel_size_of(inst)
    resources: dict = {
        "requests": {"cpu": str(threads * ranks), "memory": pods.k8s.memory},
        "limits": {"memory": pods.k8s.memory},
    }
    if device.startswith("cuda"):
        resources["limits"]["nvidia.com/gpu"] = ranks
    env = {}
    if cluster.transfer.backend == "nixl":
        env["UCX_TLS"] = pods.k8s.ucx_tls or (UCX_TLS_CUDA if device.startswith("cuda") else UCX_TLS_CPU)
    command = ["pdserve", SUBCOMMAND[role], "--config", CONFIG_FILE, "--name", inst.name]
    container = pods.container(
        role, command, {"http": inst.port, "kv": inst.transfer_port}, resources, PROBE_PATH, env=env
    )
    labels = names.labels(role, inst.name)
    spec = {
        "serviceName": names.headless(role),
        "replicas": 1,
        "selector": {"matchLabels": {**names.selector(role), "pdserve.io/instance": inst.name}},
        "template": pods.template(labels, inst.port, container, inst.name),
    }
    return names.meta_object("apps/v1", "StatefulSet", names.statefulset(inst), labels, spec=spec)


def _router_deployment(pods: _PodParts) -> dict:
    cluster, k8s, names = pods.cluster, pods.k8s, pods.names
    resources = {
        "requests": {"cpu": k8s.router_cpu, "memory": k8s.router_memory},
        "limits": {"memory": k8s.router_memory},
    }
    container = pods.container(
        "router",
        ["pdserve", "router", "--config", CONFIG_FILE],
        {"http": cluster.router.port},
        resources,
        LIVENESS_PATH_ROUTER,
        env={},
    )
    labels = names.labels("router")
    spec = {
        "replicas": cluster.router.replicas,
        "selector": {"matchLabels": names.selector("router")},
        "template": pods.template(labels, cluster.router.port, container, None),
    }
    return names.meta_object("apps/v1", "Deployment", names.router, labels, spec=spec)


def _planner_objects(pods: _PodParts) -> list[dict]:
    """The routers' headless Service, the planner's Deployment and, when it scales instances, its account."""
    cluster, k8s, names = pods.cluster, pods.k8s, pods.names
    name, port = f"{names.cluster}-planner", cluster.planner.port
    headless = {
        "clusterIP": "None",
        "selector": names.selector("router"),
        "ports": [{"name": "http", "port": cluster.router.port, "targetPort": "http", "protocol": "TCP"}],
    }
    objects = [names.meta_object("v1", "Service", f"{names.router}-headless", names.labels("router"), spec=headless)]
    resources = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}}
    command = ["pdserve", "planner", "--config", CONFIG_FILE]
    container = pods.container("planner", command, {"http": port}, resources, PROBE_PATH, env={})
    labels = names.labels("planner")
    template = pods.template(labels, port, container, None)
    scales = cluster.planner.mode == "act" and cluster.planner.orchestrator == "kubernetes"
    if scales:
        template["spec"] |= {"serviceAccountName": name, "automountServiceAccountToken": True}
        sets = [names.statefulset(i) for i in [*cluster.prefill, *cluster.decode]]
        rule = {"apiGroups": ["apps"], "resources": ["statefulsets/scale"], "resourceNames": sets}
        objects += [
            names.meta_object("v1", "ServiceAccount", name, labels, automountServiceAccountToken=False),
            names.meta_object(
                "rbac.authorization.k8s.io/v1", "Role", name, labels, rules=[rule | {"verbs": ["get", "patch"]}]
            ),
            names.meta_object(
                "rbac.authorization.k8s.io/v1",
                "RoleBinding",
                name,
                labels,
                roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                subjects=[{"kind": "ServiceAccount", "name": name, "namespace": k8s.namespace}],
            ),
        ]
    spec = {"replicas": 1, "selector": {"matchLabels": names.selector("planner")}, "template": template}
    objects.append(names.meta_object("apps/v1", "Deployment", name, labels, spec=spec))
    return objects


def _router_service(cluster: ClusterConfig, k8s: KubernetesConfig, names: _Names) -> dict:
    spec = {
        "type": k8s.router_service_type,
        "selector": names.selector("router"),
        "ports": [{"name": "http", "port": cluster.router.port, "targetPort": "http", "protocol": "TCP"}],
    }
    return names.meta_object("v1", "Service", names.router, names.labels("router"), spec=spec)


def _disruption_budget(names: _Names, role: str) -> dict:
    spec = {"maxUnavailable": 1, "selector": {"matchLabels": names.selector(role)}}
    return names.meta_object(
        "policy/v1", "PodDisruptionBudget", f"{names.cluster}-{role}", names.labels(role), spec=spec
    )


def _network_policy(names: _Names, role: str, http_ports: list[int], open_to_all: bool = False) -> dict:
    """Who may reach a role's pods (see the module docstring)."""
    http = [{"protocol": "TCP", "port": port} for port in sorted(set(http_ports))]
    ingress: list[dict]
    if open_to_all:
        ingress = [{"ports": http}]
    else:
        members = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": names.cluster}}}
        ingress = [{"from": [members]}, {"ports": http}]
    spec = {"podSelector": {"matchLabels": names.selector(role)}, "policyTypes": ["Ingress"], "ingress": ingress}
    return names.meta_object(
        "networking.k8s.io/v1", "NetworkPolicy", f"{names.cluster}-{role}", names.labels(role), spec=spec
    )
