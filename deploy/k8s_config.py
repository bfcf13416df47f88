"""The cluster YAML's optional ``kubernetes:`` section: what `pdserve render k8s`
needs beyond the cluster itself (image, namespace, resources, names).

Everything here only shapes the rendered manifests (deploy/k8s.py); no server
process reads it. Example::

    kubernetes:
      name: pdserve-demo          # object-name prefix (default: pdserve-<config file stem>)
      namespace: llm
      image: registry.example.com/pdserve:0.1.0   # default: pdserve:<this package's version>
      memory: 8Gi                 # memory request and limit of each prefill/decode pod
      node_selector: {nvidia.com/gpu.present: "true"}   # server pods only (GPU nodes)
      tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deploy.config_security import Strict

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # a Service name must be one (RFC 1035 label)
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"  # a Kubernetes resource quantity, e.g. 500m, 4Gi


class KubernetesConfig(Strict):
    """``name`` prefixes every object (default ``pdserve-<config file stem>``);
    ``image`` defaults to ``pdserve:<version>`` (the tag deploy/Dockerfile's
    build line gives; never a moving ``latest``); ``secret_name`` is the Secret
    the user creates with the internal secret and the API keys (default
    ``<name>-secrets``); ``memory`` is each server pod's memory request and
    limit (its CPU request is its engine's ``num_threads``);
    ``node_selector`` and ``tolerations`` go to the server pods (GPU nodes:
    the router needs none); ``network_policy`` renders a NetworkPolicy per
    role (see deploy/k8s.py);
    ``prestop_s`` is how long a leaving pod keeps serving before SIGTERM starts
    its drain, so that the router's DNS discovery (``discovery.interval_s``)
    has stopped picking it first."""

    name: str | None = Field(default=None, pattern=DNS_LABEL, max_length=40)
    namespace: str = Field(default="default", pattern=DNS_LABEL, max_length=63)
    image: str | None = Field(default=None, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    secret_name: str | None = Field(default=None, pattern=DNS_LABEL, max_length=63)
    memory: str = Field(default="4Gi", pattern=QUANTITY)
    router_cpu: str = Field(default="1", pattern=QUANTITY)
    router_memory: str = Field(default="2Gi", pattern=QUANTITY)
    router_replicas: int = Field(default=1, ge=1)
    router_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    prestop_s: int = Field(default=10, ge=0, le=600)
    model_pvc: str | None = None  # a PersistentVolumeClaim mounted read-only at `model:` when it is a folder
    # UCX_TLS of server pods with the nixl backend (default: transports that cross pods, see deploy/k8s.py)
    ucx_tls: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict] = Field(default_factory=list)  # Kubernetes Toleration objects, as written there
    network_policy: bool = True
