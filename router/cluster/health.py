"""Passive health: what real requests say about a worker (docs/architecture.md).

A worker that streams tokens or answers calls is alive, whatever its
``/health`` would say under load. Every answer the router gets from a worker
(a decode event, a prefill reply) is noted here (``answered``: it sets
``Worker.last_seen`` and clears ``Worker.request_failures``). The registry's
active check (router/cluster/registry.py) polls every worker, on its own HTTP
client (router/app.py), busy ones too, since only the poll reports a worker's
load; a check of a busy worker that times out is not counted while its
requests speak for it.

A failed call takes a worker out of rotation (``WorkerRegistry.mark_down``,
until an active check passes) when it proves the worker cannot take work:

* at once on ``LEAVES_AT_ONCE``: the connection was refused or reset, or the
  worker said its engine is down or it is draining;
* after ``failures_to_leave`` of ``COUNTED`` in a row with no answer in
  between: a call that timed out, a cut stream, an answer the router cannot
  read. One slow answer is load, several with nothing else are a fault.

Any other outcome is the worker's answer about one request (no room, a lease
that expired, a checksum that failed): the worker is alive, so it stays.
This class is the one writer of ``last_seen`` and ``request_failures``.
"""

from __future__ import annotations

from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import WorkerFailed
from transfer.outcome import Outcome

LEAVES_AT_ONCE = frozenset(
    {Outcome.UNREACHABLE, Outcome.ENGINE_DOWN, Outcome.DRAINING, Outcome.WRONG_ROLE, Outcome.STALE_EPOCH}
)
COUNTED = frozenset({Outcome.TIMED_OUT, Outcome.STREAM_CUT, Outcome.WORKER_ERROR})


class PassiveHealth:
    def __init__(self, registry: WorkerRegistry, failures_to_leave: int = 3) -> None:
        self.registry = registry
        self.failures_to_leave = failures_to_leave

    def answered(self, worker: Worker) -> None:
        """``worker`` answered a real call: it is alive now."""
        worker.answered()

    def failed(self, worker: Worker, exc: WorkerFailed) -> None:
        """A call to ``worker`` failed with ``exc``: maybe take it out of rotation (see the module doc)."""
        if exc.outcome in LEAVES_AT_ONCE:
            self.registry.mark_down(worker, str(exc))
        elif exc.outcome in COUNTED:
            if worker.call_failed(self.failures_to_leave):
                self.registry.mark_down(worker, f"{self.failures_to_leave} failed calls in a row, the last: {exc}")
