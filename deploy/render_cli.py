"""`pdserve render k8s CONFIG --out DIR`: Kubernetes manifests from a cluster YAML.

Plain YAML files, one object each, that ``kubectl apply -f DIR`` applies; the
objects and why they look as they do are described in deploy/k8s.py.
"""

from __future__ import annotations

import argparse

import yaml

HEADER = "# Rendered by `pdserve render k8s` from {source}; edit the cluster YAML and render again.\n"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    render = subparsers.add_parser(
        "render",
        help="render deployment files from a cluster config (Kubernetes manifests)",
        description="Render the files that run a cluster config on another platform.",
    )
    targets = render.add_subparsers(dest="target", metavar="TARGET", required=True)
    k8s = targets.add_parser(
        "k8s",
        help="Kubernetes manifests for `kubectl apply -f DIR`",
        description="Write one YAML file per Kubernetes object into DIR: a ConfigMap with the cluster YAML, "
        "headless Services (the router's DNS discovery), one StatefulSet per prefill/decode "
        "instance, the router's Deployment and Service, a PodDisruptionBudget per role and (unless "
        "kubernetes.network_policy is false) a NetworkPolicy per role. Secrets are referenced by "
        "name, never written: create the Secret it names with kubectl (printed at the end).",
    )
    k8s.add_argument("config", help="cluster YAML file, e.g. configs/1p1d.yaml")
    k8s.add_argument(
        "--out", required=True, help="folder for the manifests (created; files it rendered before are replaced)"
    )
    k8s.add_argument(
        "--name", default=None, help="object-name prefix (default kubernetes.name, else pdserve-<config file stem>)"
    )
    k8s.add_argument("--namespace", default=None, help="default kubernetes.namespace, else default")
    k8s.add_argument(
        "--image",
        default=None,
        help="container image (default kubernetes.image, else pdserve:<version>; build it with deploy/Dockerfile)",
    )
    k8s.set_defaults(func=run_k8s)


def run_k8s(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deploy.k8s import render

    rendered = render(Path(args.config), name=args.name, namespace=args.namespace, image=args.image)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.yaml"):  # objects of a previous render (an instance since removed, say)
        if old.read_text().startswith(HEADER.split("{", 1)[0]):
            old.unlink()
    header = HEADER.format(source=args.config)
    for i, obj in enumerate(rendered.objects):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(header + to_yaml(obj))
        print(path)
    keys = " ".join(f"--from-file={key}=./{key}" for key in rendered.secret_keys)
    print(
        f"\nCreate the Secret first, from files that hold the values ({', '.join(rendered.secret_keys)}; "
        f"the internal secret at least 16 characters, API keys one per line):\n"
        f"  kubectl -n {rendered.namespace} create secret generic {rendered.secret_name} {keys}\n"
        f"then: kubectl apply -f {out}"
    )
    return 0


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people to read: no anchors, multi-line strings as ``|`` blocks."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False)
