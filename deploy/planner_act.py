"""How the planner's decisions take effect: a role switch through the router, or replicas on Kubernetes.

* ``PoolSwitch``: in a cluster of fixed instances (``pdserve launch``), one
  instance of the donor role becomes the other through the router's admin
  API (``POST /admin/workers/NAME/role``, router/admin.py), which drains it,
  flips it in place and puts it back in rotation. The donors are the
  instances with the fewest requests in flight. A decision of several
  moves takes all its donors out of rotation at once first (``drain``), so the
  streams each one migrates off land on servers that stay in their role,
  never on the next donor (where they would migrate again, and a third
  move is past the router's ``migration_limit``: a failed request).
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

    def donors(self, workers: list[WorkerView], to: Role, count: int = 1) -> list[WorkerView]:
        """The ``count`` instances of the other role in rotation with the fewest requests in flight (then by
        name); fewer when the role has fewer."""
        source = "decode" if to == "prefill" else "prefill"
        candidates = sorted(
            (w for w in workers if w.role == source and w.in_rotation), key=lambda w: (w.inflight, w.name)
        )
        if not candidates:
            raise ActError(f"no {source} server in rotation to become {to}")
        return candidates[:count]

    def donor(self, workers: list[WorkerView], to: Role) -> WorkerView:
        """The one donor of a single switch (``donors``)."""
        return self.donors(workers, to)[0]

    def _post(self, path: str, body: dict | None, what: str) -> httpx.Response:
        try:
            r = self._http.post(f"{self.router_url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise ActError(f"{what}: {exc}") from None
        if r.status_code != 200:
            raise ActError(f"{what}: {r.status_code} {r.text[:300]}")
        return r

    def drain(self, names: list[str]) -> None:
        """Take ``names`` out of the router's rotation together (``POST /admin/workers/drain``): nothing new
        goes to them, and each decode server's streams migrate off at once, onto servers that stay in
        rotation, none onto another of ``names``."""
        self._post("/admin/workers/drain", {"names": names}, f"draining {', '.join(names)}")

    def resume(self, name: str) -> None:
        """Put ``name`` back in rotation (a donor drained for a switch that was not made)."""
        self._post(f"/admin/workers/{name}/resume", None, f"resuming {name}")

    def switch(self, name: str, to: Role) -> float:
        """Switch ``name`` to ``to`` through the router's role route; the seconds it took, as the router
        measured them. Answers after the router says the switch is done."""
        r = self._post(f"/admin/workers/{name}/role", {"role": to}, f"switching {name} to {to}")
        try:
            return float(r.json()["seconds"])
        except (ValueError, KeyError, TypeError):
            return float("nan")  # switched; the router did not say how long it took

    def apply(self, decision: Decision, workers: list[WorkerView]) -> tuple[str, float]:
        """Switch one instance (the donor of ``workers``); its name and the seconds the switch took."""
        assert decision.action == "switch" and decision.switch_to is not None
        w = self.donor(workers, decision.switch_to)
        return w.name, self.switch(w.name, decision.switch_to)

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
