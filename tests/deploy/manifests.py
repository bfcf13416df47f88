"""Render a cluster YAML with the real command line and read the manifests back."""

from __future__ import annotations

from pathlib import Path

import yaml

from deploy.cli import main
from deploy.config import ClusterConfig, parse_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


class Manifests:
    """The objects `pdserve render k8s` wrote into a folder, with look-ups by kind and name."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.files = sorted(out.glob("*.yaml"))
        self.objects = [yaml.safe_load(f.read_text()) for f in self.files]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        (obj,) = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        return obj

    def workloads(self) -> list[dict]:
        return self.of_kind("StatefulSet") + self.of_kind("Deployment")

    def pod_config(self) -> ClusterConfig:
        """The cluster YAML every pod reads, from the ConfigMap the pods mount."""
        (cm,) = self.of_kind("ConfigMap")
        return parse_config(yaml.safe_load(cm["data"]["cluster.yaml"]), "ConfigMap")

    def text(self) -> str:
        return "\n".join(f.read_text() for f in self.files)


def render(config: Path, out: Path, *args: str) -> Manifests:
    assert main(["render", "k8s", str(config), "--out", str(out), *args]) == 0
    return Manifests(out)


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_of(c: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port
