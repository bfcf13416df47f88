"""bench/compare/cache_sweep.py's pure parts: the run order of router counts and rounds, the pooled table
per router count, the cluster config with several routers behind the front."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.compare.cache_sweep import (
    config_for,
    counter,
    format_replica_table,
    replica_counts,
    replica_table,
    role_tokens,
    run_label,
    run_plan,
)
from deploy.config import ClusterConfig


def test_router_counts_alternate_their_order_every_other_round():
    assert run_plan(["on+cache_aware"], [1, 2], 3) == [
        (0, "on+cache_aware", 1),
        (0, "on+cache_aware", 2),
        (1, "on+cache_aware", 2),
        (1, "on+cache_aware", 1),
        (2, "on+cache_aware", 1),
        (2, "on+cache_aware", 2),
    ]
    assert run_plan(["off", "on+cache_aware"], [1], 1) == [(0, "off", 1), (0, "on+cache_aware", 1)]


def test_a_single_run_keeps_the_variants_folder_name():
    assert run_label("on+cache_aware", 1, 0, single=True) == "on+cache_aware"
    assert run_label("on+cache_aware", 2, 1, single=False) == "on+cache_aware-2r-round1"


def test_router_counts_parse_and_bad_ones_are_refused():
    assert replica_counts("1,2") == [1, 2]
    assert replica_counts("2,1") == [2, 1]
    for bad in ("0,2", "1,1", "one", "1,"):
        with pytest.raises(argparse.ArgumentTypeError):
            replica_counts(bad)


def row(replicas: int, d: tuple[float, float], p: tuple[float, float], ttft: float, variant: str = "v") -> dict:
    return {
        "variant": variant,
        "replicas": replicas,
        "d_hits": d[0],
        "d_queries": d[1],
        "p_hits": p[0],
        "p_queries": p[1],
        "ttft_p50_ms": ttft,
    }


def test_rounds_pool_tokens_and_ratios_are_to_the_first_router_count():
    rows = [
        row(1, (90, 100), (50, 100), 80.0),
        row(2, (80, 100), (50, 100), 70.0),
        row(2, (70, 100), (60, 100), 90.0),
        row(1, (270, 300), (0, 0), 100.0),
    ]
    one, two = replica_table(rows)
    assert (one["replicas"], one["rounds"]) == (1, 2)
    assert one["d_hit_rate"] == pytest.approx(360 / 400)
    assert one["p_hit_rate"] == pytest.approx(50 / 100)  # a round that looked nothing up adds nothing
    assert (one["d_ratio"], one["p_ratio"]) == (1.0, 1.0)
    assert one["ttft_p50_ms"] == 90.0 and one["ttft_p50_each_ms"] == [80.0, 100.0]
    assert two["d_hit_rate"] == pytest.approx(150 / 200)
    assert two["d_ratio"] == pytest.approx((150 / 200) / (360 / 400))
    assert two["p_ratio"] == pytest.approx((110 / 200) / (50 / 100))
    assert two["ttft_p50_ms"] == 80.0
    table = format_replica_table([one, two])
    assert "| v | 2 | 2 | 75.0% | 0.833 | 55.0% | 1.100 | 80 ms (70 / 90) |" in table.splitlines()


def test_each_variant_has_its_own_base_and_no_lookups_give_no_ratio():
    a1, b2, b1 = replica_table(
        [
            row(1, (50, 100), (0, 0), 1.0, "a"),
            row(2, (0, 0), (0, 0), 1.0, "b"),
            row(1, (10, 100), (0, 0), 1.0, "b"),
        ]
    )
    assert (a1["variant"], a1["d_ratio"]) == ("a", 1.0)
    assert (b2["variant"], b2["replicas"], b2["d_hit_rate"]) == ("b", 2, 0.0)
    assert math.isnan(b2["d_ratio"])
    assert b1["d_hit_rate"] == pytest.approx(0.1) and math.isnan(b1["d_ratio"])  # its base looked nothing up


def test_counters_sum_every_label_set_over_the_named_servers():
    hits = "pdserve_prefix_cache_hits_tokens_total"
    delta = {
        "d0": {hits + '{tier="gpu"}': 3.0, hits: 4.0},
        "d1": {hits: 5.0, hits + "x": 9.0},
        "p0": {hits: 100.0},
    }
    assert counter(delta, "d0", hits) == 7.0
    assert role_tokens(delta, ["d0", "d1", "d9"], hits) == 12.0


@pytest.mark.parametrize("layout", ["1p2d", "2p2d"])
def test_two_routers_get_the_front_on_the_router_port_and_ports_of_their_own(layout):
    data = config_for("tiny", True, "cache_aware", replicas=2, layout=layout)
    router = data["router"]
    assert (router["replicas"], router["policy"]) == (2, "cache_aware")
    servers = [*data["prefill"], *data["decode"]]
    ports = [router["port"], *router["replica_ports"], *(s["port"] for s in servers), *(s["kv_port"] for s in servers)]
    assert len(set(ports)) == len(ports) == 3 + 2 * len(servers)
    assert data["engine"]["prefix_caching"] is True
    cluster = ClusterConfig.model_validate(data)
    assert cluster.router_replica_ports == router["replica_ports"]


def test_one_router_is_the_config_as_before():
    data = config_for("tiny", False, "round_robin")
    assert "replicas" not in data["router"] and "replica_ports" not in data["router"]
    assert [s["name"] for s in data["decode"]] == ["d0", "d1"] and data["engine"]["prefix_caching"] is False
