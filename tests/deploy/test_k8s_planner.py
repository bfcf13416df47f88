"""`pdserve render k8s` with a planner: its Deployment, the routers' headless Service it reads, and, when
it scales instances, the least RBAC that takes (get and patch on this cluster's StatefulSets' scale)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy.planner_signals import Routers
from tests.deploy.manifests import REPO, container, render
from tests.deploy.test_k8s_schemas import VERSIONS


def config_with(tmp_path: Path, planner: dict) -> Path:
    data = yaml.safe_load((REPO / "configs" / "2p2d.yaml").read_text())
    data["planner"] = planner
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_scaling_planner_gets_an_account_that_may_only_scale_this_clusters_statefulsets(tmp_path):
    m = render(config_with(tmp_path, {"mode": "act", "orchestrator": "kubernetes"}), tmp_path / "out", "--name", "pd")
    for obj in m.objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    role = m.named("Role", "pd-planner")
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["statefulsets/scale"],
            "resourceNames": ["pd-p0", "pd-p1", "pd-d0", "pd-d1"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = m.named("RoleBinding", "pd-planner")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pd-planner"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pd-planner", "namespace": "default"}]
    assert m.named("ServiceAccount", "pd-planner")["automountServiceAccountToken"] is False
    planner = m.named("Deployment", "pd-planner")
    pod = planner["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("pd-planner", True)
    assert container(planner)["command"] == ["pdserve", "planner", "--config", "/etc/pdserve/config/cluster.yaml"]
    others = [w for w in m.workloads() if w["metadata"]["name"] != "pd-planner"]
    assert others and all(w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False for w in others)
    headless = m.named("Service", "pd-router-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == m.named("Deployment", "pd-router")["spec"]["selector"]["matchLabels"]
    config = m.pod_config().planner
    assert (config.routers, config.namespace) == ("pd-router-headless:8000", "default")


def test_a_recommending_planner_gets_no_account_and_no_planner_no_objects(tmp_path):
    m = render(config_with(tmp_path, {"mode": "recommend"}), tmp_path / "a", "--name", "pd")
    assert not m.of_kind("Role") and not m.of_kind("ServiceAccount")
    pod = m.named("Deployment", "pd-planner")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    m = render(REPO / "configs" / "2p2d.yaml", tmp_path / "b", "--name", "pd")
    assert not [o for o in m.objects if o["metadata"]["name"] in ("pd-planner", "pd-router-headless")]


@pytest.mark.parametrize(
    ("planner", "message"),
    [
        ({"mode": "act", "min_prefill": 3, "min_decode": 2}, "more than the 4 instances listed"),
        ({"mode": "act", "orchestrator": "kubernetes", "min_prefill": 3}, "at most the instances listed"),
        ({"mode": "act", "routers": "no port"}, "planner.routers"),
    ],
)
def test_a_planner_the_cluster_cannot_hold_is_refused_naming_why(tmp_path, planner, message):
    from deploy.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(config_with(tmp_path, planner))


def test_routers_behind_a_dns_name_are_its_addresses_at_each_look():
    routers = Routers([], None, dns="localhost:8123")
    assert "http://127.0.0.1:8123" in routers.urls
    assert Routers(["http://a:1"], None).urls == ["http://a:1"]
    assert Routers([], None, dns="name.invalid:80").urls == []
    routers.close()
