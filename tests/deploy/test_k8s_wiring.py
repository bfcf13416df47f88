"""The rendered manifests are wired together: selectors pick exactly the pods
they should, ports and probes are the servers' own, the router's DNS discovery
names are the headless Services, and each pod's advertised host is the DNS
name Kubernetes gives it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import yaml

from decode_server.app import create_app as decode_app
from deploy.cli import main
from deploy.config import parse_config
from deploy.k8s import CONFIG_FILE, GRACE_MARGIN_S, RUN_AS, SECRET_DIR, SECRET_KEY_INTERNAL
from deploy.version import version
from engine.config import EngineConfig
from prefill_server.app import create_app as prefill_app
from router.app import create_app as router_app
from router.settings import RouterSettings
from server_common.guard import Drain
from server_common.settings import ServerSettings
from tests.deploy.manifests import CONFIGS, REPO, container, port_of, render

IDS = [c.stem for c in CONFIGS]


def _get_routes(app) -> set[str]:
    return {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}


@pytest.fixture(scope="module")
def routes() -> dict[str, set[str]]:
    """GET routes of the app each `pdserve` subcommand serves (apps built, not started)."""
    settings = ServerSettings(name="d0", role="decode", engine=EngineConfig(model="unused"))
    service = SimpleNamespace(settings=settings, drain=Drain(lambda: 0), faults=None)
    router = router_app(
        RouterSettings(model_path="unused", served_model_name="m", workers=()),
        model=SimpleNamespace(vocab_size=512, max_model_len=4096),
    )  # what the OpenAPI document reads
    return {
        "decode": _get_routes(decode_app(service)),
        "prefill": _get_routes(prefill_app(service)),
        "router": _get_routes(router),
    }


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_selectors_pick_exactly_their_own_pods(config, tmp_path):
    m = render(config, tmp_path)
    cluster = m.pod_config()
    for w in m.workloads():
        assert _matches(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
        others = [o for o in m.workloads() if o is not w]
        assert not any(
            _matches(w["spec"]["selector"]["matchLabels"], o["spec"]["template"]["metadata"]["labels"]) for o in others
        ), w["metadata"]["name"]
    for svc in m.of_kind("Service"):
        backends = [
            w for w in m.workloads() if _matches(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        picked = {container(w)["command"][-1] if w["kind"] == "StatefulSet" else "router" for w in backends}
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        expected = {"router"} if component == "router" else {i.name for i in getattr(cluster, component)}
        assert picked == expected, svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            assert all(port["targetPort"] in {p["name"] for p in container(w)["ports"]} for w in backends)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_each_instance_runs_with_its_config_ports_and_its_own_name(config, tmp_path):
    m = render(config, tmp_path)
    cluster = m.pod_config()
    names = []
    for sts in m.of_kind("StatefulSet"):
        c = container(sts)
        _, subcommand, _, config_file, _, name = c["command"]
        names.append(name)
        inst = cluster.instance(name)
        assert (subcommand, config_file) == ({"prefill": "prefill"}.get(cluster.role_of(name), "decode"), CONFIG_FILE)
        assert (port_of(c, "http"), port_of(c, "kv")) == (inst.port, inst.transfer_port)
        assert sts["spec"]["replicas"] == 1
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(inst.port)
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/path"]) == ("true", "/metrics")
    assert sorted(names) == sorted(i.name for i in cluster.instances())
    (router,) = m.of_kind("Deployment")
    assert container(router)["command"] == ["pdserve", "router", "--config", CONFIG_FILE]
    assert port_of(container(router), "http") == cluster.router.port
    (router_svc,) = [s for s in m.of_kind("Service") if s["spec"].get("clusterIP") != "None"]
    assert router_svc["spec"]["ports"][0]["port"] == cluster.router.port
    assert cluster.router_host == "0.0.0.0"


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_probes_hit_routes_the_process_serves(config, tmp_path, routes):
    m = render(config, tmp_path)
    for w in m.workloads():
        c = container(w)
        served = routes["router" if c["command"][1] == "router" else c["command"][1]]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] in served, (w["metadata"]["name"], probe, get["path"])
            assert get["port"] in {p["name"] for p in c["ports"]}
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        if w["kind"] == "StatefulSet":
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_the_router_discovers_workers_by_the_headless_service_names(config, tmp_path):
    m = render(config, tmp_path)
    cluster = m.pod_config()
    headless = {s["metadata"]["name"]: s for s in m.of_kind("Service") if s["spec"].get("clusterIP") == "None"}
    assert cluster.discovery.kind == "dns"
    assert sorted({n.rpartition(":")[0] for n in cluster.discovery.names}) == sorted(headless)
    ports = {int(n.rpartition(":")[2]) for n in cluster.discovery.names}
    assert ports == {i.port for i in cluster.instances()}  # every instance is found at its own HTTP port
    for svc in headless.values():
        assert svc["spec"]["publishNotReadyAddresses"] is False  # one address per *ready* pod
    for sts in m.of_kind("StatefulSet"):
        name = container(sts)["command"][-1]
        service = headless[sts["spec"]["serviceName"]]
        assert _matches(service["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
        # the pod's DNS name under its StatefulSet's Service is the host it binds and advertises
        pod = f"{sts['metadata']['name']}-0"
        ns = sts["metadata"]["namespace"]
        assert cluster.host_of(cluster.instance(name)) == f"{pod}.{service['metadata']['name']}.{ns}.svc.cluster.local"


def test_router_replicas_are_the_deployment_s_behind_its_service_each_with_a_replica_s_share(tmp_path, capsys):
    config = tmp_path / "replicas.yaml"
    data = {
        "model": "tiny",
        "router": {"port": 8000, "replicas": 3, "max_inflight_per_worker": 8},
        "prefill": [{"name": "p0", "port": 8100}],
        "decode": [{"name": "d0", "port": 8200}],
    }
    config.write_text(yaml.safe_dump(data))
    m = render(config, tmp_path / "out")
    deployment = m.named("Deployment", "pdserve-replicas-router")
    service = m.named("Service", "pdserve-replicas-router")
    assert deployment["spec"]["replicas"] == 3
    assert _matches(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert port_of(container(deployment), "http") == 8000
    assert container(deployment)["command"] == ["pdserve", "router", "--config", CONFIG_FILE]  # no pod has an index
    (cm,) = m.of_kind("ConfigMap")  # what each of the three pods runs with, the Secret mounted here instead
    (tmp_path / "mounted").mkdir()
    (tmp_path / "mounted" / SECRET_KEY_INTERNAL).write_text("internal-secret-of-the-test\n")
    pod = parse_config(yaml.safe_load(cm["data"]["cluster.yaml"].replace(SECRET_DIR, str(tmp_path / "mounted"))), "cm")
    assert pod.router.replicas == 3
    router = pod.router_settings(REPO)
    assert (router.port, router.limit_share, router.discovery.max_inflight) == (8000, 1 / 3, 2)  # 3 x 2 <= 8
    (budget,) = [b for b in m.of_kind("PodDisruptionBudget") if b["metadata"]["name"].endswith("-router")]
    assert _matches(budget["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    config.write_text(yaml.safe_dump({**data, "kubernetes": {"router_replicas": 2}}))
    assert main(["render", "k8s", str(config), "--out", str(tmp_path / "again")]) == 2
    assert "kubernetes.router_replicas (2) differs from router.replicas (3)" in capsys.readouterr().err


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_a_leaving_pod_has_time_to_drain(config, tmp_path):
    m = render(config, tmp_path)
    cluster = m.pod_config()
    for w in m.workloads():
        pod = w["spec"]["template"]["spec"]
        prestop = container(w)["lifecycle"]["preStop"]["exec"]["command"]
        assert prestop[0] == "sleep" and int(prestop[1]) >= cluster.discovery.interval_s
        drain = math.ceil(cluster.drain_timeout_s)
        assert pod["terminationGracePeriodSeconds"] == int(prestop[1]) + drain + GRACE_MARGIN_S


def test_cpu_requests_follow_threads_a_cuda_instance_gets_a_gpu_and_nixl_crosses_pods(tmp_path):
    config = tmp_path / "gpu.yaml"
    config.write_text(
        "model: /models/qwen3\nengine: {num_threads: 2}\ndevice: cpu\n"
        "security: {internal_secret_file: /nowhere}\ntransfer: {backend: nixl}\n"
        "prefill: [{name: p0, port: 8100, device: cuda, num_threads: 4}]\n"
        "decode: [{name: d0, port: 8200}]\n"
        "kubernetes: {memory: 12Gi, model_pvc: qwen3-weights, namespace: llm}\n"
    )
    m = render(config, tmp_path / "out")
    p0, d0 = (container(m.named("StatefulSet", f"pdserve-gpu-{n}")) for n in ("p0", "d0"))
    assert p0["resources"] == {
        "requests": {"cpu": "4", "memory": "12Gi"},
        "limits": {"memory": "12Gi", "nvidia.com/gpu": 1},
    }
    assert d0["resources"] == {"requests": {"cpu": "2", "memory": "12Gi"}, "limits": {"memory": "12Gi"}}
    assert {"name": "model", "mountPath": "/models/qwen3", "readOnly": True} in d0["volumeMounts"]
    assert {o["metadata"]["namespace"] for o in m.objects} == {"llm"}
    # NIXL between pods: no shared-memory, CMA or CUDA IPC transport (pods do not share those namespaces)
    assert {"name": "UCX_TLS", "value": "^sm,cma,cuda_ipc"} in p0["env"]
    assert {"name": "UCX_TLS", "value": "tcp"} in d0["env"]
    zmq = render(REPO / "configs" / "2p1d.yaml", tmp_path / "zmq")
    assert all(e["name"] != "UCX_TLS" for w in zmq.workloads() for e in container(w)["env"])


def test_adding_an_instance_restarts_no_running_server_but_a_changed_setting_restarts_all(tmp_path):
    """`kubectl apply` restarts a pod when its template changes; the config digest is the only part
    of a server's template that depends on other instances."""
    base = (REPO / "configs" / "1p1d.yaml").read_text()
    (tmp_path / "a.yaml").write_text(base)
    (tmp_path / "b.yaml").write_text(base + "  - {name: d1, port: 8210}\n")  # appended to decode:
    (tmp_path / "c.yaml").write_text(base.replace("lease_s: 30", "lease_s: 20"))
    a, b, c = (render(tmp_path / f"{n}.yaml", tmp_path / n, "--name", "demo") for n in "abc")
    for sts in a.of_kind("StatefulSet"):
        assert b.named("StatefulSet", sts["metadata"]["name"]) == sts
        assert c.named("StatefulSet", sts["metadata"]["name"]) != sts
    assert [container(s)["command"][-1] for s in b.of_kind("StatefulSet")] == ["p0", "d0", "d1"]
    for other in (b, c):
        assert other.of_kind("Deployment") != a.of_kind("Deployment")


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_pods_run_unprivileged_with_a_pinned_image_and_memory_limits(config, tmp_path):
    m = render(config, tmp_path)
    for w in m.workloads():
        pod, c = w["spec"]["template"]["spec"], container(w)
        assert c["image"] == f"pdserve:{version()}"  # the package's own tag, never a moving latest
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the one writable place, also HOME
        assert {"name": "HOME", "value": "/tmp"} in c["env"]
        assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_budgets_and_policies_select_exactly_their_role_s_pods(config, tmp_path):
    m = render(config, tmp_path)
    roles = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] for w in m.workloads()}
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        objects = m.of_kind(kind)
        assert sorted(o["metadata"]["labels"]["app.kubernetes.io/component"] for o in objects) == sorted(roles)
        for obj in objects:
            selector = obj["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]
            picked = {
                w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                for w in m.workloads()
                if _matches(selector, w["spec"]["template"]["metadata"]["labels"])
            }
            assert picked == {obj["metadata"]["labels"]["app.kubernetes.io/component"]}
    for pdb in m.of_kind("PodDisruptionBudget"):
        assert pdb["spec"]["maxUnavailable"] == 1


def test_the_network_policy_keeps_strangers_off_the_data_plane_but_not_off_http(tmp_path):
    """Pods of the cluster reach a server on any port (UCX listens where it likes); anyone else
    only on the server's HTTP port (metrics); the router's port is open to all."""
    m = render(REPO / "configs" / "1p1d.yaml", tmp_path)
    cluster = m.pod_config()
    (prefill,) = [p for p in m.of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-prefill")]
    members, http_only = prefill["spec"]["ingress"]
    assert members == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {
                        "app.kubernetes.io/instance": prefill["metadata"]["labels"]["app.kubernetes.io/instance"]
                    }
                }
            }
        ]
    }
    assert http_only == {"ports": [{"protocol": "TCP", "port": cluster.prefill[0].port}]}
    assert all(cluster.prefill[0].transfer_port != p["port"] for p in http_only["ports"])
    (router,) = [p for p in m.of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-router")]
    assert router["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": cluster.router.port}]}]


def test_gpu_placement_hooks_go_to_server_pods_and_policies_can_be_left_out(tmp_path):
    config = tmp_path / "placed.yaml"
    config.write_text(
        "model: /models/qwen3\nsecurity: {internal_secret_file: /nowhere}\n"
        "prefill: [{name: p0, port: 8100}]\ndecode: [{name: d0, port: 8200}]\n"
        "kubernetes:\n  image: registry.example.com/pdserve@sha256:" + "a" * 64 + "\n"
        "  network_policy: false\n"
        "  node_selector: {nvidia.com/gpu.present: 'true'}\n"
        "  tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]\n"
    )
    m = render(config, tmp_path / "out")
    assert m.of_kind("NetworkPolicy") == []
    for w in m.workloads():
        pod = w["spec"]["template"]["spec"]
        assert container(w)["image"] == "registry.example.com/pdserve@sha256:" + "a" * 64
        if w["kind"] == "StatefulSet":
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        else:
            assert "nodeSelector" not in pod and "tolerations" not in pod


def test_a_tensor_parallel_instance_is_one_pod_with_a_gpu_and_threads_per_rank(tmp_path):
    config = tmp_path / "tp.yaml"
    config.write_text(
        "model: /models/qwen3\nengine: {num_threads: 2, tensor_parallel_size: 2}\ndevice: cuda\n"
        "security: {internal_secret_file: /nowhere}\n"
        "colocated: [{name: c0, port: 8200}, {name: c1, port: 8300, tensor_parallel_size: 4, device: cpu}]\n"
        "kubernetes: {memory: 12Gi, model_pvc: qwen3-weights}\n"
    )
    m = render(config, tmp_path / "out")
    c0, c1 = (container(m.named("StatefulSet", f"pdserve-tp-{n}")) for n in ("c0", "c1"))
    assert c0["resources"] == {
        "requests": {"cpu": "4", "memory": "12Gi"},
        "limits": {"memory": "12Gi", "nvidia.com/gpu": 2},
    }
    assert c1["resources"] == {"requests": {"cpu": "8", "memory": "12Gi"}, "limits": {"memory": "12Gi"}}
    assert [w["spec"]["replicas"] for w in m.workloads() if w["kind"] == "StatefulSet"] == [1, 1]
