"""One cell of the fault matrix: a burst in flight, a fault at a stage, then the checks.

A cell runs on a live cluster and leaves it healthy for the next one::

    1. pause the burst at the stage    before_prefill: P holds every /prefill (reservations made on D)
                                       mid_transfer:   then P stops after pushing layer 0 of the batch
                                       after_first_token: D slows its steps; every stream got text
    2. the fault                       kill -9 p0 | kill -9 d0 | drop / delay p0's next 2 notices |
                                       corrupt d0's next KV write | hang up half of the burst
    3. release the pauses, send a second wave of requests (it meets faults still armed)
    4. every request ends: correct, clear error, or left (hung up); restart what was killed
    5. disarm; every live server back to free == total within lease + margin; a new request is correct

Faults armed at "after_first_token" find the burst past its transfers: they
hit the second wave, which is what arming them at that moment means.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tests.faults.client import Call, Client, Outcome
from tests.faults.harness import FaultCluster
from tests.waiting import until

FAULTS = ("kill_prefill", "kill_decode", "drop_notice", "delay_notice", "corrupt_block", "client_disconnect")
STAGES = ("before_prefill", "mid_transfer", "after_first_token")
BURST = 6
WAVE2 = 2
MARGIN_S = 4.0  # on top of the lease: how long any request or cleanup may take here
STEP_DELAY_S = 0.05


@dataclass
class CellResult:
    layout: str
    fault: str
    stage: str
    outcomes: list[Outcome] = field(default_factory=list)
    leaked: int = 0
    router_ok: bool = False
    seconds: float = 0.0
    evidence: str = ""  # what shows the fault really happened
    fault_seen: bool = False

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    def row(self) -> dict:
        return {
            "layout": self.layout,
            "fault": self.fault,
            "stage": self.stage,
            "requests": len(self.outcomes),
            "correct": self.count("correct"),
            "clear_errors": self.count("error"),
            "left": self.count("left"),
            "wrong": self.count("wrong"),
            "leaked_blocks": self.leaked,
            "router_ok": self.router_ok,
            "seconds": round(self.seconds, 1),
            "evidence": self.evidence,
            "not_correct": [
                f"{o.kind} ({'streamed' if o.stream else 'whole'}, {o.seconds:.1f} s): {o.detail}"
                for o in self.outcomes
                if o.kind != "correct"
            ],
        }


async def reach_stage(c: FaultCluster, client: Client, stage: str) -> list[Call]:
    if stage == "after_first_token":
        for d in c.decode:
            c.arm(d, step_delay_s=STEP_DELAY_S)
        calls = client.burst(BURST)
        await until(lambda: all(x.first_token.is_set() for x in calls if x.stream), c.lease_s, "first tokens")
        return calls
    for p in c.prefill:
        c.arm(p, hold_prefill=True)
    calls = client.burst(BURST)
    await until(lambda: sum(c.faults(p)["held"] for p in c.prefill) == BURST, c.lease_s, "burst held on P")
    if stage == "mid_transfer":
        busy = [p for p in c.prefill if c.faults(p)["held"]]
        for p in c.prefill:
            c.arm(p, stall_after_layer=0)  # replaces the hold: the burst enters the engine
        await until(lambda: all(c.faults(p)["stalled"] for p in busy), c.lease_s, "P stalled mid-transfer")
    return calls


async def apply_fault(c: FaultCluster, client: Client, calls: list[Call], fault: str) -> list[str]:
    """Do the harm; returns the servers killed (already being restarted)."""
    p, d = c.prefill[0], c.decode[0]
    if fault in ("kill_prefill", "kill_decode"):
        victim = p if fault == "kill_prefill" else d
        c.kill(victim)
        c.restart(victim)  # comes back while the cell goes on
        return [victim]
    if fault == "drop_notice":
        c.arm(p, drop_notices=2)
    elif fault == "delay_notice":
        c.arm(p, delay_notices=2, notice_delay_s=c.lease_s + 0.5)
    elif fault == "corrupt_block":
        c.arm(d, corrupt_writes=1)
    elif fault == "client_disconnect":
        await asyncio.gather(*(client.hang_up(x) for x in calls[: BURST // 2]))
    return []


def evidence(c: FaultCluster, fault: str, before: dict, result: CellResult, killed: list[str]) -> tuple[str, bool]:
    """What shows the fault really happened, and whether it did."""
    p, d = c.prefill[0], c.decode[0]
    if fault == "drop_notice":
        dropped = c.faults(p)["injected"]["notices_dropped"] - before["dropped"]
        return f"notices dropped: {dropped}", dropped > 0
    if fault == "delay_notice":
        delayed = c.faults(p)["injected"]["notices_delayed"] - before["delayed"]
        late = discarded(c) - before["discarded"]
        return f"notices delayed: {delayed}, late ones discarded on D: {late:.0f}", delayed > 0 and late > 0
    if fault == "corrupt_block":
        corrupted = c.faults(d)["injected"]["writes_corrupted"] - before["corrupted"]
        failures = c.metric(d, 'pdserve_transfer_failures_total{outcome="checksum_mismatch"}') - before["checksum"]
        return f"writes corrupted: {corrupted}, checksum failures on {d}: {failures:.0f}", failures > 0
    if fault == "client_disconnect":
        return f"hung up: {result.count('left')}", result.count("left") > 0
    return f"{', '.join(killed)} killed and restarted", bool(killed)


def discarded(c: FaultCluster) -> float:
    return sum(c.metric(d, 'pdserve_transfers_discarded_total{reason="expired"}') for d in c.decode)


async def run_cell(c: FaultCluster, layout: str, fault: str, stage: str, expected: dict[str, str]) -> CellResult:
    result = CellResult(layout, fault, stage)
    started = time.monotonic()
    p, d = c.prefill[0], c.decode[0]
    before = {
        "dropped": c.faults(p)["injected"]["notices_dropped"],
        "delayed": c.faults(p)["injected"]["notices_delayed"],
        "discarded": discarded(c),
        "corrupted": c.faults(d)["injected"]["writes_corrupted"],
        "checksum": c.metric(d, 'pdserve_transfer_failures_total{outcome="checksum_mismatch"}'),
    }
    client = Client(c.router_url, expected, deadline_s=c.lease_s + MARGIN_S)
    try:
        calls = await reach_stage(c, client, stage)
        killed = await apply_fault(c, client, calls, fault)
        for name in c.servers():
            if name not in killed:  # a restarted one starts with nothing armed
                c.release(name)
        calls += client.burst(WAVE2, offset=BURST)
        result.outcomes = await client.outcomes(calls)
        if killed:
            await asyncio.to_thread(c.wait_back, killed)
        if fault == "delay_notice" and before["delayed"] < c.faults(p)["injected"]["notices_delayed"]:
            await until(lambda: discarded(c) > before["discarded"], c.lease_s + MARGIN_S, "late notice discarded")
        result.evidence, result.fault_seen = evidence(c, fault, before, result, killed)
        c.disarm_all()
        result.leaked, _ = await asyncio.to_thread(c.leaked_blocks, c.lease_s + MARGIN_S)
        check = client.start(expected_prompt(expected), stream=False)
        result.router_ok = (await client.outcomes([check]))[0].kind == "correct"
    finally:
        await client.aclose()
        result.seconds = time.monotonic() - started
    return result


def expected_prompt(expected: dict[str, str]) -> str:
    return next(iter(expected))
