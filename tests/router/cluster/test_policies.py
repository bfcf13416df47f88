import pytest

from router.cluster.policies import LeastLoaded, RoundRobin, make_policy
from router.cluster.registry import Worker


def names(ws):
    return [w.name for w in ws]


def test_round_robin_rotates_the_starting_worker():
    ws = [Worker("d0", "decode", "u0"), Worker("d1", "decode", "u1"), Worker("d2", "decode", "u2")]
    rr = RoundRobin()
    assert names(rr.order(ws)) == ["d0", "d1", "d2"]
    assert names(rr.order(ws)) == ["d1", "d2", "d0"]
    assert names(rr.order(ws)) == ["d2", "d0", "d1"]
    assert names(rr.order(ws)) == ["d0", "d1", "d2"]
    assert rr.order([]) == []


def test_least_loaded_decode_prefers_fewer_requests_then_more_free_blocks():
    a = Worker("a", "decode", "u", inflight=2, free_blocks=100)
    b = Worker("b", "decode", "u", inflight=1, queue_depth=0, free_blocks=10)
    c = Worker("c", "decode", "u", inflight=1, queue_depth=0, free_blocks=50)
    assert names(LeastLoaded().order([a, b, c])) == ["c", "b", "a"]


def test_least_loaded_prefill_counts_queued_and_inflight_tokens():
    a = Worker("a", "prefill", "u", queued_tokens=100)
    b = Worker("b", "prefill", "u", inflight_tokens=50, inflight=1)
    c = Worker("c", "prefill", "u")
    assert names(LeastLoaded().order([a, b, c])) == ["c", "b", "a"]


def test_least_loaded_ties_keep_config_order():
    ws = [Worker(n, "decode", "u") for n in ("x", "y", "z")]
    assert names(LeastLoaded().order(ws)) == ["x", "y", "z"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="random"):
        make_policy("random")
