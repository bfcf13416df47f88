"""The planner's loop (deploy/planner_loop.py): each decision reads the last window_s of the routers' figures,
records what it decided and did, and starts its history again after a switch."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from deploy.planner import SHIFT_LIMIT, EngineShape, Planner, PlannerSettings, Slo
from deploy.planner_act import ActError, PoolSwitch
from deploy.planner_loop import PlannerLoop
from deploy.planner_signals import Histogram, Snapshot, WorkerView
from engine.step_cost import DEFAULT_STEP_COST, StepCost

SLO = Slo(ttft_s=1.0, tpot_s=0.05)
WORKERS = [WorkerView("p0", "prefill", True, 0)] + [WorkerView(f"d{k}", "decode", True, 0) for k in range(3)]


def snapshot(requests: int, prompt_tokens: int) -> dict[str, Snapshot]:
    """One router after ``requests`` first tokens, all fast, and ``prompt_tokens`` prompt tokens."""
    ttft = Histogram(((0.5, float(requests)), (float("inf"), float(requests))), float(requests))
    return {"r": Snapshot(float(prompt_tokens), 0.0, 0.0, ttft, Histogram((), 0.0))}


class Routers:
    def __init__(self, pages: list[dict[str, Snapshot]]) -> None:
        self.pages = pages
        self.scrapes = 0

    def scrape(self) -> dict[str, Snapshot]:
        self.scrapes += 1
        return self.pages.pop(0)

    def workers(self) -> list[WorkerView]:
        return WORKERS


class Switch(PoolSwitch):
    """The router's role route, as answered: one switch of d0, half a second."""

    def __init__(self) -> None:
        self.calls = 0

    def apply(self, decision, workers) -> tuple[str, float]:
        self.calls += 1
        return "d0", 0.5


def loop(pages, act=None, window_s: float = 10.0) -> tuple[PlannerLoop, list[float]]:
    times = [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0]
    clock = iter(times)
    shape = EngineShape(64, 512, 100_000)
    planner = Planner(PlannerSettings(confirm=2, cooldown_s=0), DEFAULT_STEP_COST, shape, SLO)
    return PlannerLoop(planner, Routers(pages), SLO, act, window_s, clock=lambda: next(clock)), times


def test_each_decision_reads_the_last_window_of_the_routers_figures():
    # a steady 1 request and 1,000 prompt tokens a second: every window says so, whatever its length
    pages = [snapshot(2 * k, 2000 * k) for k in range(8)]
    planner_loop, _ = loop(pages, window_s=4.0)
    assert planner_loop.step() is None  # the baseline
    decisions = [planner_loop.step() for _ in range(6)]
    loads = [d["load"] for d in planner_loop.decisions]
    assert [round(x["seconds"]) for x in loads] == [2, 4, 4, 4, 4, 4]
    assert all(x["prompt_tokens"] == 1000 * x["seconds"] and x["ttft_met"] == 1.0 for x in loads)
    assert all(d is not None for d in decisions)


def test_a_switch_carried_out_starts_the_history_again_and_says_what_it_did():
    pages = [snapshot(10 * k, 60_000 * k) for k in range(12)]  # 30,000 prompt tokens a second: P is the need
    switch = Switch()
    planner_loop, _ = loop(pages, act=switch)
    planner_loop.step()
    first, second = planner_loop.step(), planner_loop.step()
    assert (first.action, second.action, second.switch_to) == ("hold", "switch", "prefill")
    assert switch.calls == 1 and planner_loop.decisions[-1]["carried_out"] == "switched d0 to prefill in 0.50 s"
    planner_loop.step()  # the window after the switch reaches back only to the scrape taken right after it
    assert planner_loop.decisions[-1]["load"]["seconds"] == 2.0


class MigratingRouter(PoolSwitch):
    """A router's view of p0 and decode servers d0.. with their streams, as the admin routes change it:
    a decode server drained or switched has its streams migrate to the decode server in rotation with the
    fewest (the router's ``least_loaded`` pick; any pick may land on the next donor), each stream's moves
    counted; ``refuse``: the switch of that worker is refused (409), leaving it as it was."""

    def __init__(self, streams: list[int], refuse: str | None = None) -> None:
        self.role = {"p0": "prefill"} | {f"d{k}": "decode" for k in range(len(streams))}
        self.rotation = set(self.role)
        self.streams: dict[str, list[str]] = {"p0": []} | {
            f"d{k}": [f"d{k}-s{j}" for j in range(n)] for k, n in enumerate(streams)
        }
        self.moves: dict[str, int] = {s: 0 for held in self.streams.values() for s in held}
        self.refuse = refuse
        self.calls: list[str] = []

    def view(self) -> list[WorkerView]:
        return [WorkerView(n, self.role[n], n in self.rotation, len(self.streams[n])) for n in sorted(self.role)]

    def _move_off(self, name: str) -> None:
        for stream in self.streams[name]:
            others = [n for n in sorted(self.rotation) if self.role[n] == "decode" and n != name]
            target = min(others, key=lambda n: len(self.streams[n]))
            self.streams[target].append(stream)
            self.moves[stream] += 1
        self.streams[name] = []

    def drain(self, names: list[str]) -> None:  # all out of rotation, then each one's streams move
        self.calls.append(f"drain {' '.join(names)}")
        self.rotation.difference_update(names)
        for name in names:
            if self.role[name] == "decode":
                self._move_off(name)

    def resume(self, name: str) -> None:
        self.calls.append(f"resume {name}")
        self.rotation.add(name)

    def switch(self, name: str, to) -> float:
        self.calls.append(f"switch {name}")
        if name == self.refuse:
            raise ActError(f"switching {name} to {to}: 409 switch_in_progress")
        self.rotation.discard(name)  # out of rotation first, as the router's role route does
        self._move_off(name)
        self.role[name] = to
        self.rotation.add(name)
        return 0.25

    def apply(self, decision, workers) -> tuple[str, float]:  # one move: the donor from the view given
        name = self.donor(workers, decision.switch_to).name
        return name, self.switch(name, decision.switch_to)


def migrating_loop(router: MigratingRouter, max_moves: int) -> PlannerLoop:
    pages = [snapshot(10 * k, 60_000 * k) for k in range(12)]  # 30,000 prompt tokens a second: P is the need
    planner_loop, _ = loop(pages, act=router)
    planner_loop.routers.workers = router.view  # type: ignore[method-assign]
    planner_loop.planner.settings = replace(planner_loop.planner.settings, max_moves=max_moves)
    return planner_loop


def test_several_moves_drain_their_donors_first_so_no_stream_lands_on_the_next_donor():
    # The decode servers hold 1, 1, 2, 2, 3 and 3 streams. Donor by donor from the view after each switch,
    # d0's stream would go to d1, d1 would be the next donor (2 streams now, first by name), and that
    # stream would move again, and again: past the router's migration_limit of 2, a failed request.
    router = MigratingRouter([1, 1, 2, 2, 3, 3])
    planner_loop = migrating_loop(router, max_moves=4)
    for _ in range(3):
        planner_loop.step()
    decision = planner_loop.decisions[-1]
    assert (decision["action"], decision["moves"], decision["prefill"]) == ("switch", 4, 5)  # toward 6P1D
    assert router.calls == ["drain d0 d1 d2 d3", "switch d0", "switch d1", "switch d2", "switch d3"]
    assert decision["carried_out"] == "; ".join(f"switched d{k} to prefill in 0.25 s" for k in range(4))
    assert max(router.moves.values()) == 1  # every stream moved once, onto d4 or d5, which stay decode
    assert sorted(len(router.streams[n]) for n in ("d4", "d5")) == [6, 6]
    assert planner_loop.routers.scrapes == 4  # the history started again


def test_one_move_is_switched_without_a_drain_of_its_own():
    router = MigratingRouter([2, 1])
    planner_loop = migrating_loop(router, max_moves=1)
    for _ in range(3):
        planner_loop.step()
    assert router.calls == ["switch d1"] and planner_loop.decisions[-1]["moves"] == 1
    assert router.streams["d0"] == ["d0-s0", "d0-s1", "d1-s0"]


def test_a_refused_move_puts_the_donors_not_switched_back_in_rotation():
    router = MigratingRouter([1, 1, 2, 2, 3, 3], refuse="d1")
    planner_loop = migrating_loop(router, max_moves=3)
    for _ in range(3):
        planner_loop.step()
    decision = planner_loop.decisions[-1]
    assert decision["carried_out"] == (
        "switched d0 to prefill in 0.25 s; failed: switching d1 to prefill: 409 switch_in_progress"
    )
    assert router.calls == ["drain d0 d1 d2", "switch d0", "switch d1", "resume d1", "resume d2"]
    assert router.rotation == set(router.role) and router.role["d0"] == "prefill"
    registry = planner_loop.metrics.registry
    assert registry.get_sample_value("pdserve_planner_act_failures_total") == 1.0


class Refused(PoolSwitch):
    """The router's role route refusing every switch."""

    def __init__(self) -> None:
        pass

    def apply(self, decision, workers) -> tuple[str, float]:
        raise ActError("switching d0 to prefill: 409 switch_in_progress")


def test_a_refused_switch_is_counted_and_changes_nothing_the_window_reads():
    pages = [snapshot(10 * k, 60_000 * k) for k in range(12)]
    planner_loop, _ = loop(pages, act=Refused())
    for _ in range(4):
        planner_loop.step()
    made = list(planner_loop.decisions)
    refused = "failed: switching d0 to prefill: 409 switch_in_progress"
    assert [(d["action"], d["carried_out"]) for d in made] == [("hold", None), ("switch", refused), ("hold", None)]
    registry = planner_loop.metrics.registry
    assert registry.get_sample_value("pdserve_planner_act_failures_total") == 1.0
    assert [d["load"]["seconds"] for d in made] == [2.0, 4.0, 6.0]  # no reset: the window kept growing


def test_a_pool_that_may_grow_asks_the_launcher_and_holds_until_the_routers_show_the_new_count():
    pages = [snapshot(10 * k, 60_000 * k) for k in range(12)]  # 30,000 prompt tokens a second
    switch = Switch()
    planner_loop, _ = loop(pages, act=switch)
    planner_loop.planner.settings = replace(planner_loop.planner.settings, max_instances=6, min_instances=4)
    for _ in range(5):
        planner_loop.step()
    made = [(d["action"], d["switch_to"], d["carried_out"]) for d in planner_loop.decisions]
    assert made[1] == ("scale", "prefill", "asked the launcher to start a prefill server")
    assert planner_loop.wanted == {"seq": 1, "prefill": 2, "decode": 3, "change": "start", "role": "prefill"}
    # the routers still show 1P3D: the start is in flight, and nothing else is decided meanwhile
    assert [d["action"] for d in planner_loop.decisions][2:] == ["hold", "hold"]
    assert "in flight" in planner_loop.decisions[-1]["reason"] and switch.calls == 0


def test_the_planner_serves_three_reads_and_drops_a_client_that_never_sends(monkeypatch):
    import socket

    import httpx

    import deploy.planner_loop as planner_loop_module
    from deploy.planner_loop import serve_reads
    from tests.support.cluster import free_ports

    monkeypatch.setattr(planner_loop_module, "READ_TIMEOUT_S", 0.2)
    planner_loop, _ = loop([snapshot(0, 0)])
    (port,) = free_ports(1)
    server = serve_reads(planner_loop, "127.0.0.1", port, "L1")
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "instance": "planner", "launch_id": "L1"}
        assert httpx.get(f"{url}/decisions").json() == {"decisions": []}
        assert httpx.get(f"{url}/wanted").json() == {"launch_id": "L1", "wanted": None}
        assert 'pdserve_planner_decisions_total{action="switch"} 0.0' in httpx.get(f"{url}/metrics").text
        assert httpx.get(f"{url}/admin/role").status_code == 404
        assert httpx.post(f"{url}/health").status_code == 501
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle.settimeout(10)
            assert idle.recv(1) == b""  # closed by the server after its read timeout, not by us
    finally:
        server.shutdown()
        server.server_close()


def test_the_queues_read_are_exported_and_named_in_the_decision():
    pages = [snapshot(2 * k, 2000 * k) for k in range(3)]  # 1,000 prompt tokens a second
    for k, page in enumerate(pages):  # 5,000 more prompt tokens queued at p0 and one more request waiting each 2 s
        page["r"] = replace(page["r"], waiting=float(k), queued=(("p0", 5000.0 * k),))
    planner_loop, _ = loop(pages)
    planner_loop.step()
    decision = planner_loop.step()
    # 5,000 queued at p0 and one request of 1,000 prompt tokens waiting: 6,000 to drain over the 2 s window
    assert decision.reason == (
        "every role has room (busiest at 0.46); growing prefill queue of 6000 tokens: +0.34 prefill servers' worth"
    )
    registry = planner_loop.metrics.registry
    assert registry.get_sample_value("pdserve_planner_prefill_queued_tokens") == 5000.0
    assert registry.get_sample_value("pdserve_planner_waiting_requests") == 1.0
    load = planner_loop.decisions[-1]["load"]
    queues = (load["queued_tokens_before"], load["queued_tokens"], load["waiting_before"], load["waiting"])
    assert queues == (0, 5000, 0, 1)


def arriving_page(requests: int, prompt_tokens: int, max_tokens: int) -> dict[str, Snapshot]:
    """One router that has counted ``requests`` arrivals with these tokens in all, each also served."""
    page = snapshot(requests, prompt_tokens)
    return {"r": replace(page["r"], arrived=float(requests), arrived_prompt=prompt_tokens, arrived_max=max_tokens)}


def test_after_a_shift_in_the_mix_the_window_goes_on_and_its_requests_are_read_at_the_new_sizes():
    # 2 s apart: three intervals of 5 requests of 1000/10 tokens, then 10 a scrape of 100/400
    totals = [(5 * k, 5000 * k, 50 * k) for k in range(4)]
    totals += [(15 + 10 * k, 15_000 + 1000 * k, 150 + 4000 * k) for k in range(1, 5)]
    planner_loop, _ = loop([arriving_page(*t) for t in totals], window_s=8.0)
    for _ in range(7):
        planner_loop.step()
    made = list(planner_loop.decisions)
    assert [d["shifted"] for d in made] == [False, False, False, True, False, False]
    assert made[3]["reason"].endswith(
        "; the mix shifted (prefill and decode arrivals): the window's requests at the sizes of the last 2.0 s"
    )
    assert made[3]["shift"] == {"rate": 2.71, "prefill": 26.44, "decode": 69.4}
    # tested against the arrivals since the shift, not the window's rest (another mix): no shift again
    assert [d["shift"]["prefill"] for d in made[4:]] == [0.0, 0.0]
    assert made[4]["reason"].endswith("; since the shift: the window's requests at the sizes of the last 4.0 s")
    assert made[5]["reason"].endswith("; since the shift: the window's requests at the sizes of the last 6.0 s")
    # the window is not started again: it grows to 8 s and slides
    assert [d["load"]["seconds"] for d in made] == [2.0, 4.0, 6.0, 8.0, 8.0, 8.0]
    # each decision's last part is kept beside its window
    assert [d["recent"]["arrived"] for d in made] == [5, 5, 5, 10, 10, 10]
    assert made[4]["recent"]["arrived_max_tokens"] == 4000 and made[4]["load"]["arrived"] == 30


class TraceRouters:
    """One router counting the arrivals of a list of (time, prompt tokens, max_tokens), each also served
    within its SLOs, at the time ``clock`` says; its workers as ``roles`` (name to role) hold them."""

    def __init__(self, events: list[tuple[float, int, int]], roles: dict[str, str]) -> None:
        self.events, self.roles, self.now = events, roles, 0.0

    def scrape(self) -> dict[str, Snapshot]:
        came = [e for e in self.events if e[0] < self.now]
        return arriving_page(len(came), sum(p for _, p, _ in came), sum(m for _, _, m in came))

    def workers(self) -> list[WorkerView]:
        return [WorkerView(name, role, True, 0) for name, role in self.roles.items()]


class TraceSwitch(PoolSwitch):
    """Switches one instance of the other role at once, and remembers when."""

    def __init__(self, routers: TraceRouters) -> None:
        self.routers, self.made = routers, []

    def apply(self, decision, workers) -> tuple[str, float]:
        name = next(n for n, r in self.routers.roles.items() if r != decision.switch_to)
        self.routers.roles[name] = decision.switch_to
        self.made.append((round(self.routers.now, 2), decision.switch_to))
        return name, 0.1


def phase_trace(gap: float = 0.95) -> list[tuple[float, int, int]]:
    """The arrivals of `python -m bench.compare.phase_shift --rates 2.5,5,4 --phase-s 30` across its
    output-heavy -> mixed boundary, as its open loop draws them (seed k + 7919 for phase k; the first at 0):
    30 s of 5 a second of 48/160 tokens, then, ``gap`` later (the phase's last answers ending), 4 a second of
    400/60, the boundary at 0."""

    def draws(rate: float, seed: int) -> list[float]:
        rng, t, out = np.random.default_rng(seed + 7919), 0.0, []
        while t < 30.0:
            out.append(t)
            t += float(rng.exponential(1 / rate))
        return out

    return [(t - 30 - gap, 48, 160) for t in draws(5, 1)] + [(t, 400, 60) for t in draws(4, 2)]


def test_a_shift_into_the_mixed_phase_is_read_at_the_first_decision_in_it(caplog):
    """Decisions every 2.02 s, the first in the mixed phase 1.1 s into it (as in the runs that missed the
    shift). Its last 2 s hold 3 requests of 400 prompt tokens after 23 of 48 in the 6 s before: within 3
    standard deviations of the window's mean request (80 tokens, raised by the 3 themselves) for the test of
    tokens against the rest's rate, as were the next decision's 4 after a rest that held those 3 (so the first
    move came 7.16 s in); a change of the mean request is what the new mix is, and reads at once. The phase's
    first 3 s bring 7 requests where 12 are its mean, so its arrivals alone would ask for no move: the
    window's request rate at the new sizes does."""
    routers = TraceRouters(phase_trace(), {"i0": "prefill", "i1": "decode", "i2": "decode", "i3": "decode"})
    act = TraceSwitch(routers)
    cost = StepCost(base=0.002, per_token=0.001, per_attn=0.0, per_seq=0.001)  # the bench's mock profile
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    planner = Planner(PlannerSettings(confirm=2, cooldown_s=4.0), cost, EngineShape(64, 2048, 1 << 30), slo)
    ticks = [round(1.1 + 2.02 * k, 2) for k in range(-7, 6)]  # -13.04 ... 11.2
    planner_loop = PlannerLoop(planner, routers, slo, act, 8.0, clock=lambda: routers.now)
    made = []
    caplog.set_level(logging.INFO, logger="pdserve.planner")
    for tick in ticks:
        routers.now = tick
        d = planner_loop.step()
        if d is not None and tick > -2:
            made.append(
                (tick, d.action, d.shifted, [r for r in ("prefill", "decode") if d.shift.get(r, 0) > SHIFT_LIMIT])
            )
    assert made[:3] == [
        (-0.92, "hold", False, []),  # the output phase's last decision
        (1.1, "hold", True, ["prefill"]),
        (3.12, "switch", False, []),
    ]
    first = planner_loop.decisions[-len(made) + 1]
    assert first["recent"]["arrived"] == 3 and first["recent"]["arrived_prompt_tokens"] == 1200
    assert first["shift"] == {"rate": 2.95, "prefill": 22.11, "decode": 4.95}
    assert first["reason"] == (
        "wanted 1/2: 3P1D puts the busiest role at 0.43 instead of 1.30;"
        " the mix shifted (prefill arrivals): the window's requests at the sizes of the last 2.0 s"
    )
    # the window's 24 requests at 400 prompt tokens each: 1.20 prefill servers' worth; read from the 7 of the
    # last 4 s alone they would be 0.70, and no move (the runs that missed the shift moved 7.2 s in)
    assert planner_loop.decisions[-len(made) + 2]["reason"] == (
        "3P1D puts the busiest role at 0.40 instead of 1.20;"
        " since the shift: the window's requests at the sizes of the last 4.0 s"
    )
    assert act.made == [(3.12, "prefill"), (9.18, "prefill")]
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.planner"]
    assert lines[-len(made) + 1].endswith("[last 2.0 s: 3 arrived, 594 prompt and 89 max tokens a second]")
