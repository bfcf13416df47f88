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
    """What `pdserve render k8s` needs beyond the cluster itself: names, image, resources, placement. It only
    shapes the rendered manifests (deploy/k8s.py); no server process reads it."""

    name: str | None = Field(default=None, pattern=DNS_LABEL, max_length=40)
    """Prefix of every object's name; null: `pdserve-<config file stem>` (`render k8s --name` overrides)."""
    namespace: str = Field(default="default", pattern=DNS_LABEL, max_length=63)
    """The namespace of every object."""
    image: str | None = Field(default=None, min_length=1)
    """The image of every pod; null: `pdserve:<this package's version>` (`render k8s --image` overrides)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """The `imagePullPolicy` of every container."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain, the end of each server pod's advertised name."""
    secret_name: str | None = Field(default=None, pattern=DNS_LABEL, max_length=63)
    """The Secret the user creates with the internal secret and the API keys; null: `<name>-secrets`."""
    memory: str = Field(default="4Gi", pattern=QUANTITY)
    """Memory request and limit of each server pod (its CPU request is its engine's `num_threads`)."""
    router_cpu: str = Field(default="1", pattern=QUANTITY)
    """CPU request of each router pod (a Kubernetes quantity, e.g. 500m)."""
    router_memory: str = Field(default="2Gi", pattern=QUANTITY)
    """Memory request and limit of each router pod."""
    router_replicas: int | None = Field(default=None, ge=1)
    """Replicas of the router's Deployment: `router.replicas` says it now (each router's share of the workers
    follows it); set here, it must equal that."""
    router_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """The type of the router's Service."""
    prestop_s: int = Field(default=10, ge=0, le=600)
    """Seconds a leaving pod keeps serving before SIGTERM starts its drain, so that the router's DNS discovery
    has stopped picking it first."""
    model_pvc: str | None = None
    """A PersistentVolumeClaim mounted read-only at `model` when that is a folder; null: the model is in the
    image."""
    ucx_tls: str | None = None
    """`UCX_TLS` of server pods with the nixl backend; null: transports that cross pods (`tcp` on CPU,
    `^sm,cma,cuda_ipc` on CUDA)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """The `nodeSelector` of the server pods (e.g. GPU nodes; the router's pods get none)."""
    tolerations: list[dict] = Field(default_factory=list)
    """The tolerations of the server pods, Kubernetes Toleration objects as written there."""
    network_policy: bool = True
    """Render a NetworkPolicy per role: server pods take any port from the cluster's pods, only their HTTP port
    from anyone else."""
