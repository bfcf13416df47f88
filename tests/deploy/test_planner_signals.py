"""The planner's reading of the routers' /metrics (deploy/planner_signals.py), off the router's own
metrics objects (router/metrics.py) as Prometheus renders them."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from deploy.planner_signals import parse_metrics, window
from router.cluster.admission import Admission, AdmissionSettings
from router.cluster.registry import Worker, WorkerRegistry
from router.metrics import RouterMetrics


def router_page(ttfts: list[float], tpots: list[float], prompt: int, output: int, metrics=None) -> tuple:
    """A router's page after these requests: ``output`` tokens streamed over them, ``len(ttfts)`` of them first
    tokens (the rest are inter-token samples), counted at finish too."""
    m = metrics or RouterMetrics(WorkerRegistry([]))
    for t in ttfts:
        m.ttft.observe(t)
    for _ in range(output - len(ttfts)):
        m.itl.observe(0.01)
    for t in tpots:
        m.tpot.observe(t)
    m.prompt_tokens.inc(prompt)
    m.completion_tokens.inc(output)
    return m, generate_latest(m.registry).decode()


def test_a_page_gives_tokens_and_the_histograms():
    _, page = router_page([0.2, 0.4, 3.0], [0.03], prompt=300, output=40)
    s = parse_metrics(page)
    assert (s.prompt_tokens, s.output_tokens, s.later_tokens, s.ttft.count, s.tpot.count) == (300, 40, 37, 3, 1)
    assert s.ttft.buckets[-1] == (float("inf"), 3)


def test_the_share_within_a_target_is_exact_at_a_bound_and_linear_between_two():
    _, page = router_page([0.2, 0.4, 0.9, 3.0, 5000.0], [], 0, 5)
    h = parse_metrics(page).ttft
    bounds = [le for le, _ in h.buckets]
    assert 0.25 in bounds and 0.5 in bounds and 1.0 in bounds  # the router's buckets around these samples
    assert h.within(0.25) == 1 and h.within(0.5) == 2 and h.within(1.0) == 3
    assert h.within(0.375) == pytest.approx(1.5)  # halfway between 0.25 and 0.5
    assert h.within(1e9) == 4  # past the last finite bound (2560 s): the +Inf bucket is not counted


def test_a_window_adds_the_routers_up_and_leaves_out_one_that_restarted():
    a, a1 = router_page([0.1] * 4, [0.02] * 4, 400, 80)
    b, b1 = router_page([0.1] * 2, [0.02] * 2, 200, 40)
    _, a2 = router_page([0.1, 5.0], [0.02, 0.2], 300, 60, metrics=a)  # 2 more on a: one slow
    _, b2 = router_page([0.1], [0.02], 10, 2)  # b restarted: its counters began again
    before = {"a": parse_metrics(a1), "b": parse_metrics(b1)}
    after = {"a": parse_metrics(a2), "b": parse_metrics(b2), "c": parse_metrics(b2)}  # c is new
    w = window(before, after, 10.0, ttft_s=1.0, tpot_s=0.05)
    assert (w.requests, w.prompt_tokens, w.output_tokens) == (2, 300, 60)
    assert (w.ttft_met, w.tpot_met) == (0.5, 0.5)
    assert (w.prompt_tps, w.output_tps) == (30.0, 6.0)


def test_a_quiet_window_has_no_attainment():
    _, page = router_page([], [], 0, 0)
    w = window({"a": parse_metrics(page)}, {"a": parse_metrics(page)}, 10.0, 1.0, 0.05)
    assert (w.requests, w.ttft_met, w.tpot_met) == (0, None, None)


def queue_page(queued: dict[str, int], waiting: int) -> str:
    """A router's page with these prompt tokens reported queued per worker and ``waiting`` requests in its
    waiting room (real requests, admitted by nothing until the page is rendered)."""
    workers = [Worker(name, "prefill" if name.startswith("p") else "decode", f"http://{name}:1") for name in queued]
    for w in workers:
        w.apply_health({"queued_tokens": queued[w.name]})
    m = RouterMetrics(WorkerRegistry(workers))
    admission = Admission(AdmissionSettings(queue_timeout_s=60.0, poll=60.0))
    m.watch_admission(admission)

    async def render() -> str:
        async def no_slot() -> None:
            return None

        tasks = [asyncio.create_task(admission.admit(no_slot)) for _ in range(waiting)]
        while admission.waiting < waiting:
            await asyncio.sleep(0)  # each task runs to its place in the room
        page = generate_latest(m.registry).decode()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert admission.waiting == 0
        return page

    return asyncio.run(render())


def test_the_queues_are_the_waiting_rooms_added_up_and_each_prefill_server_once():
    a1, b1 = queue_page({"p0": 100, "p1": 0, "d0": 999}, 2), queue_page({"p0": 90, "p1": 0}, 0)
    a2, b2 = queue_page({"p0": 3000, "p1": 500, "d0": 7}, 4), queue_page({"p0": 2900, "p1": 600}, 3)
    assert parse_metrics(a2).waiting == 4 and parse_metrics(a2).queued == (("p0", 3000), ("p1", 500))
    before = {"a": parse_metrics(a1), "b": parse_metrics(b1)}
    w = window(before, {"a": parse_metrics(a2), "b": parse_metrics(b2)}, 10.0, 1.0, 0.05)
    # a decode server's queue is no prefill demand; two routers' reports of one server count once, the most
    assert (w.queued_tokens_before, w.queued_tokens, w.waiting_before, w.waiting) == (100, 3600, 2, 7)


def arrived_page(metrics: RouterMetrics, requests: int, prompt: int, max_tokens: int, finished_max: int) -> str:
    """The page after ``requests`` more arrived with these prompt tokens and max_tokens, and requests that
    could have generated ``finished_max`` tokens finished."""
    metrics.arrived_requests.inc(requests)
    metrics.arrived_prompt_tokens.inc(prompt)
    metrics.arrived_max_tokens.inc(max_tokens)
    metrics.finished_max_tokens.inc(finished_max)
    return generate_latest(metrics.registry).decode()


def test_a_window_counts_the_arrivals_apart_from_what_was_admitted_and_finished():
    a, b = RouterMetrics(WorkerRegistry([])), RouterMetrics(WorkerRegistry([]))
    before = {"a": parse_metrics(arrived_page(a, 3, 300, 30, 0)), "b": parse_metrics(arrived_page(b, 1, 50, 8, 0))}
    _, admitted = router_page([0.1, 0.1], [0.02], prompt=2000, output=16, metrics=a)  # a backlog admitted
    after = {"a": parse_metrics(arrived_page(a, 10, 480, 1600, 16)), "b": parse_metrics(arrived_page(b, 2, 96, 320, 0))}
    assert after["a"].arrived == 13 and parse_metrics(admitted).arrived == 3
    w = window(before, after, 10.0, 1.0, 0.05)
    assert (w.arrived, w.arrived_prompt_tokens, w.arrived_max_tokens) == (12, 576, 1920)
    assert (w.prompt_tokens, w.finished_output_tokens, w.finished_max_tokens, w.fill) == (2000, 16, 16, 1.0)
    # a router that does not count arrivals (an earlier version): the window has none, not a share of them
    old = generate_latest(b.registry).decode()
    old = "\n".join(line for line in old.splitlines() if "arrived" not in line) + "\n"
    assert parse_metrics(old).arrived is None
    assert window(before, {**after, "b": parse_metrics(old)}, 10.0, 1.0, 0.05).arrived is None
