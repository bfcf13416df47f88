"""How the planner's decisions take effect: a role switch through the router, or replicas on Kubernetes.

* ``PoolSwitch``: in a cluster of fixed instances (``pdserve launch``), one
  instance of the donor role becomes the other through the router's admin
  API (``POST /admin/workers/NAME/role``, router/admin.py), which drains it,
  flips it in place and puts it back in rotation. The donor is the instance
  with the fewest requests in flight.
* ``DeploymentScale``: on Kubernetes, the prefill and decode Deployments'
  ``replicas`` through their scale subresource, with the official client
  (``kubernetes``), so the planner's service account needs only ``get`` and
  ``patch`` on ``deployments/scale`` (deploy/k8s.py renders that Role).
"""

from __future__ import annotations

from typing import Any

import httpx

from deploy.planner import Decision, Role
from deploy.planner_signals import WorkerView


class ActError(RuntimeError):
    """A decision that could not be carried out; the planner logs it and decides again next interval."""


class PoolSwitch:
    def __init__(self, router_url: str, secret: str | None, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self.router_url = router_url
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def donor(self, workers: list[WorkerView], to: Role) -> WorkerView:
        """The instance of the other role, in rotation, with the fewest requests in flight (then by name)."""
        source = "decode" if to == "prefill" else "prefill"
        candidates = sorted(
            (w for w in workers if w.role == source and w.in_rotation), key=lambda w: (w.inflight, w.name)
        )
        if not candidates:
            raise ActError(f"no {source} server in rotation to become {to}")
        return candidates[0]

    def apply(self, decision: Decision, workers: list[WorkerView]) -> str:
        """Switch one instance; its name. Answers after the router says the switch is done."""
        assert decision.action == "switch" and decision.switch_to is not None
        w = self.donor(workers, decision.switch_to)
        try:
            r = self._http.post(f"{self.router_url}/admin/workers/{w.name}/role", json={"role": decision.switch_to})
        except httpx.HTTPError as exc:
            raise ActError(f"switching {w.name} to {decision.switch_to}: {exc}") from None
        if r.status_code != 200:
            raise ActError(f"switching {w.name} to {decision.switch_to}: {r.status_code} {r.text[:300]}")
        return w.name

    def close(self) -> None:
        self._http.close()


class DeploymentScale:
    """The replicas of one Deployment per role, in ``namespace``, through the scale subresource."""

    def __init__(self, namespace: str, deployments: dict[Role, str], api_client: Any | None = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]  # the pod's service account
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]  # an operator's kubeconfig, outside the cluster
            api_client = client.ApiClient()
        self.namespace = namespace
        self.deployments = deployments
        self._apps = client.AppsV1Api(api_client)
        self._errors: tuple[type[Exception], ...] = (client.ApiException, OSError)

    def replicas(self) -> dict[Role, int]:
        """Each role's desired replicas as the Deployment says now."""
        try:
            scales = {
                role: self._apps.read_namespaced_deployment_scale(name, self.namespace)
                for role, name in self.deployments.items()
            }
        except self._errors as exc:
            raise ActError(f"reading the Deployments' scale: {exc}") from None
        return {role: int(s.spec.replicas or 0) if s.spec is not None else 0 for role, s in scales.items()}

    def apply(self, decision: Decision) -> dict[Role, int]:
        """Set each role's replicas to the decision's count where it differs; the counts set."""
        assert decision.action == "scale"
        wanted: dict[Role, int] = {"prefill": decision.prefill, "decode": decision.decode}
        changed = {}
        for role, count in self.replicas().items():
            if count == wanted[role]:
                continue
            body = {"spec": {"replicas": wanted[role]}}
            try:
                self._apps.patch_namespaced_deployment_scale(self.deployments[role], self.namespace, body)
            except self._errors as exc:
                raise ActError(f"scaling {self.deployments[role]} to {wanted[role]}: {exc}") from None
            changed[role] = wanted[role]
        return changed
