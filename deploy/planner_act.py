"""How the planner's decisions take effect: a role switch through the router, or replicas on Kubernetes.

* ``PoolSwitch``: in a cluster of fixed instances (``pdserve launch``), one
  instance of the donor role becomes the other through the router's admin
  API (``POST /admin/workers/NAME/role``, router/admin.py), which drains it,
  flips it in place and puts it back in rotation. The donor is the instance
  with the fewest requests in flight.
* ``InstanceScale``: on Kubernetes, where each named instance is a
  StatefulSet of one pod (deploy/k8s.py says why), a role of N runs its
  first N instances: their ``replicas`` set to 1 or 0 through the scale
  subresource, with the official client (``kubernetes``), so the planner's
  service account needs only ``get`` and ``patch`` on ``statefulsets/scale``.
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

    def apply(self, decision: Decision, workers: list[WorkerView]) -> tuple[str, float]:
        """Switch one instance; its name and the seconds the switch took, as the router measured them.
        Answers after the router says the switch is done."""
        assert decision.action == "switch" and decision.switch_to is not None
        w = self.donor(workers, decision.switch_to)
        try:
            r = self._http.post(f"{self.router_url}/admin/workers/{w.name}/role", json={"role": decision.switch_to})
        except httpx.HTTPError as exc:
            raise ActError(f"switching {w.name} to {decision.switch_to}: {exc}") from None
        if r.status_code != 200:
            raise ActError(f"switching {w.name} to {decision.switch_to}: {r.status_code} {r.text[:300]}")
        try:
            seconds = float(r.json()["seconds"])
        except (ValueError, KeyError, TypeError):
            seconds = float("nan")  # switched; the router did not say how long it took
        return w.name, seconds

    def close(self) -> None:
        self._http.close()


class InstanceScale:
    """Each role's named instances on Kubernetes (deploy/k8s.py renders one StatefulSet per instance, because
    an instance's name is its KV agent's): a role of N runs its first N instances in the config's order, each
    StatefulSet's ``replicas`` 1, and the rest 0, set through the scale subresource."""

    def __init__(self, namespace: str, instances: dict[Role, list[str]], api_client: Any | None = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]  # the pod's service account
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]  # an operator's kubeconfig
            api_client = client.ApiClient()
        self.namespace = namespace
        self.instances = instances
        self._apps = client.AppsV1Api(api_client)
        self._errors: tuple[type[Exception], ...] = (client.ApiException, OSError)

    def replicas(self) -> dict[str, int]:
        """Each instance's StatefulSet's replicas now, by StatefulSet name."""
        try:
            scales = {
                name: self._apps.read_namespaced_stateful_set_scale(name, self.namespace)
                for names in self.instances.values()
                for name in names
            }
        except self._errors as exc:
            raise ActError(f"reading the instances' scale: {exc}") from None
        return {name: int(s.spec.replicas or 0) if s.spec is not None else 0 for name, s in scales.items()}

    def apply(self, decision: Decision) -> dict[str, int]:
        """Run the first ``decision.prefill`` prefill and ``decision.decode`` decode instances and no others;
        the StatefulSets changed, with their new replicas."""
        assert decision.action == "scale"
        count: dict[Role, int] = {"prefill": decision.prefill, "decode": decision.decode}
        if any(count[role] > len(names) for role, names in self.instances.items()):
            raise ActError(f"{count} is more than the instances the config names ({self.instances})")
        now, changed = self.replicas(), {}
        for role, names in self.instances.items():
            for k, name in enumerate(names):
                want = 1 if k < count[role] else 0
                if now[name] == want:
                    continue
                try:
                    self._apps.patch_namespaced_stateful_set_scale(name, self.namespace, {"spec": {"replicas": want}})
                except self._errors as exc:
                    raise ActError(f"scaling {name} to {want}: {exc}") from None
                changed[name] = want
        return changed
