"""Discrete-event simulation of colocated and xPyD serving.

Events, in time order (ties in the order they were scheduled):

    arrival   router gets a request; colocated (or a prompt under the
              conditional-disaggregation threshold): queued on a serving
              instance; otherwise D reserves blocks (or queues the
              reservation until blocks free up) and, one hop later, P
              queues the prompt
    step end  an instance finishes a step: prompts advance by their chunk,
              decodes emit a token, finished requests free their blocks;
              on P a finished prompt's KV arrival at D is scheduled
              (layer-wise transfer overlapped with compute, costmodel)
    kv        the KV is on D; D admits the request at its next step
              boundary, emits the first token (sampled on P) and decodes
              it from the following step on

Each instance runs one step at a time (its own clock). A token's client
time is its emission plus ``overheads.egress``; a request reaches the
engines ``overheads.ingress`` after it arrives. The result is a list of
:class:`bench.load.metrics.RequestRecord`, summarised by the same code as
measured runs.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from bench.load.metrics import RequestRecord
from bench.load.workload import RequestSpec
from bench.plan.costmodel import Overheads, TransferCost
from bench.plan.sim_instances import InstanceSpec, PrefillInstance, ServingInstance, SimRequest


@dataclass(frozen=True)
class Layout:
    """A cluster to simulate. No prefill instances means colocated."""

    name: str
    serving: tuple[InstanceSpec, ...]
    prefill: tuple[InstanceSpec, ...] = ()
    transfer: TransferCost | None = None
    overheads: Overheads = Overheads()
    local_prefill_below: int = 0  # conditional disaggregation threshold (tokens)

    def __post_init__(self):
        if not self.serving:
            raise ValueError(f"layout {self.name!r} has no decode/colocated instance")
        if self.prefill and self.transfer is None:
            raise ValueError(f"layout {self.name!r} has prefill instances but no transfer cost")

    @property
    def colocated(self) -> bool:
        return not self.prefill


@dataclass
class SimResult:
    layout: str
    records: list[RequestRecord]
    duration_s: float
    utilization: dict[str, float] = field(default_factory=dict)
    steps: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)  # instance -> kind -> (n, s)


class Simulation:
    """One run of a layout over one arrival sequence. Use :func:`simulate`."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.serving = [
            ServingInstance(f"{'C' if layout.colocated else 'D'}{i}", s) for i, s in enumerate(layout.serving)
        ]
        self.prefill = [PrefillInstance(f"P{i}", s) for i, s in enumerate(layout.prefill)]
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.decode_of: dict[int, ServingInstance] = {}
        self.prefill_of: dict[int, PrefillInstance] = {}
        self.now = 0.0

    def push(self, when: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (when, next(self.seq), kind, payload))

    def run(self, requests: list[SimRequest]) -> None:
        for req in requests:
            self.push(req.arrival + self.layout.overheads.ingress, "arrival", req)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrival":
                self.on_arrival(payload)
            elif kind == "step":
                self.on_step_end(*payload)
            elif kind == "to_prefill":
                self.on_to_prefill(payload)
            else:
                self.on_kv(payload)

    # -- routing ---------------------------------------------------------
    def on_arrival(self, req: SimRequest) -> None:
        local = self.layout.colocated or req.prompt_len < self.layout.local_prefill_below
        inst = min(self.serving, key=lambda s: (s.load(), s.name))
        if not inst.can_hold(req) or not (local or any(p.can_hold(req) for p in self.prefill)):
            self.fail(req, "exceeds KV capacity")
            return
        if local:
            inst.waiting.append(req)
            self.kick(inst)
            return
        req.remote = True
        self.decode_of[req.index] = inst
        inst.pending.append(req)
        self.grant_reservations(inst)

    def grant_reservations(self, inst: ServingInstance) -> None:
        while inst.pending and inst.try_allocate(inst.pending[0]):
            req = inst.pending.popleft()
            inst.reserved.append(req)
            self.push(self.now + self.layout.overheads.pd_hop, "to_prefill", req)

    def on_to_prefill(self, req: SimRequest) -> None:
        inst = min(self.prefill, key=lambda p: (p.queued_tokens(), p.name))
        self.prefill_of[req.index] = inst
        inst.waiting.append(req)
        self.kick(inst)

    # -- steps -------------------------------------------------------------
    def kick(self, inst) -> None:
        """Starts the instance's next step if it is idle and has work."""
        if inst.busy_until is not None:
            return
        if isinstance(inst, ServingInstance):
            self.admit_arrived_kv(inst)
        plan = inst.plan_step(self.now)
        if plan is None:
            return
        inst.busy_until = self.now + plan.seconds
        inst.busy_seconds += plan.seconds
        counted = inst.steps[plan.kind]
        counted[0] += 1
        counted[1] += plan.seconds
        self.push(inst.busy_until, "step", (inst, plan))

    def on_step_end(self, inst, plan) -> None:
        inst.busy_until = None
        for req, n in plan.work:
            if req.prefilling:
                req.num_computed += n
                if req.prefilling:
                    continue
                if isinstance(inst, PrefillInstance):
                    inst.running.remove(req)
                    arrival = self.layout.transfer.arrival(req.prompt_len, req.prefill_start, self.now)
                    self.push(arrival, "kv", req)
                    continue
            self.emit(inst, req)
        if isinstance(inst, ServingInstance):
            self.grant_reservations(inst)
        self.kick(inst)

    def on_kv(self, req: SimRequest) -> None:
        prefill = self.prefill_of.pop(req.index)
        prefill.release(req)  # the transfer is done: P's blocks are free again
        self.kick(prefill)
        inst = self.decode_of[req.index]
        inst.inbox.append(req)
        self.kick(inst)

    def admit_arrived_kv(self, inst: ServingInstance) -> None:
        """At a step boundary: remote requests whose KV is here start running."""
        for req in inst.inbox:
            inst.reserved.remove(req)
            inst.running.append(req)
            req.num_computed = req.prompt_len
            self.emit(inst, req)
        inst.inbox.clear()

    def emit(self, inst: ServingInstance, req: SimRequest) -> None:
        req.generated += 1
        req.token_times.append(self.now + self.layout.overheads.egress)
        if req.generated >= req.output_len:
            req.done_at = self.now
            inst.running.remove(req)
            inst.release(req)

    def fail(self, req: SimRequest, reason: str) -> None:
        req.error = reason
        req.done_at = self.now


def to_record(req: SimRequest) -> RequestRecord:
    ok = req.error is None
    end = req.token_times[-1] if ok and req.token_times else (req.done_at or req.arrival)
    return RequestRecord(
        index=req.index,
        prompt_len=req.prompt_len,
        max_tokens=req.output_len,
        start=req.arrival,
        end=end,
        token_times=list(req.token_times),
        output_tokens=req.generated if ok else 0,
        ok=ok,
        error=req.error,
    )


def simulate(layout: Layout, specs: list[RequestSpec], arrivals: list[float]) -> SimResult:
    """Runs ``specs`` arriving at ``arrivals`` (seconds) through ``layout``."""
    if len(specs) != len(arrivals):
        raise ValueError("one arrival time per request")
    reqs = [SimRequest(s.index, t, s.prompt_len, s.output_len) for s, t in zip(specs, arrivals)]
    sim = Simulation(layout)
    sim.run(reqs)
    unfinished = [r for r in reqs if r.error is None and len(r.token_times) < r.output_len]
    assert not unfinished, f"simulation ended with {len(unfinished)} unfinished requests"
    records = [to_record(r) for r in reqs]
    start = min(arrivals, default=0.0)
    end = max((r.end for r in records), default=start)
    duration = end - start
    util = {i.name: (i.busy_seconds / duration if duration > 0 else 0.0) for i in (*sim.prefill, *sim.serving)}
    steps = {i.name: {kind: tuple(v) for kind, v in i.steps.items()} for i in (*sim.prefill, *sim.serving)}
    return SimResult(layout.name, records, duration, util, steps)
