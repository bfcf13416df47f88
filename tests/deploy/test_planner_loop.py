"""The planner's loop (deploy/planner_loop.py): each decision reads the last window_s of the routers' figures,
records what it decided and did, and starts its history again after a switch."""

from __future__ import annotations

from dataclasses import replace

from deploy.planner import EngineShape, Planner, PlannerSettings, Slo
from deploy.planner_act import ActError, PoolSwitch
from deploy.planner_loop import PlannerLoop
from deploy.planner_signals import Histogram, Snapshot, WorkerView
from engine.step_cost import DEFAULT_STEP_COST

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


def test_a_shift_in_the_mix_starts_the_window_at_the_scrape_before_the_last():
    # 2 s apart: three intervals of 5 requests of 1000/10 tokens, then 10 a scrape of 100/400
    totals = [(5 * k, 5000 * k, 50 * k) for k in range(4)]
    totals += [(15 + 10 * k, 15_000 + 1000 * k, 150 + 4000 * k) for k in range(1, 5)]
    planner_loop, _ = loop([arriving_page(*t) for t in totals], window_s=8.0)
    for _ in range(7):
        planner_loop.step()
    made = list(planner_loop.decisions)
    assert [d["shifted"] for d in made] == [False, False, False, True, False, False]
    assert made[3]["reason"].endswith("; the mix shifted (decode arrivals): read from the last 2.0 s")
    # the window: growing to 6 s, then from the scrape before the shift's: 4 s, then 6 s
    assert [d["load"]["seconds"] for d in made] == [2.0, 4.0, 6.0, 8.0, 4.0, 6.0]
    assert made[4]["load"]["arrived"] == 20 and made[4]["load"]["arrived_prompt_tokens"] == 2000
