"""planner.max_instances and planner.max_moves as the config checks them: each error names its key. The pool
scaler that starts and stops instances (deploy/launch_scale.py) runs against real processes in
tests/cluster/test_planner_grow_cluster.py."""

from __future__ import annotations

from deploy.config import parse_config
from tests.support.configs import BASE, error_of

ACT = {"mode": "act"}
LISTED = {**BASE, "decode": [{"name": "d0", "port": 9200}, {"name": "d1", "port": 9300}]}  # 1P2D


def test_max_instances_counts_the_listed_ones_and_belongs_to_a_pool():
    assert parse_config({**LISTED, "planner": {**ACT, "max_instances": 3}}, "c.yaml").planner.max_instances == 3
    assert error_of({**LISTED, "planner": {**ACT, "max_instances": 2}}) == (
        "c.yaml: planner.max_instances (2) is fewer than the 3 prefill and decode instances listed: it counts them too"
    )
    kubernetes = {**ACT, "orchestrator": "kubernetes", "max_instances": 4}
    assert error_of({**LISTED, "planner": kubernetes}) == (
        "c.yaml: planner.max_instances: only with orchestrator pool (kubernetes runs the listed ones)"
    )
    assert "'planner.max_instances'" in error_of({**LISTED, "planner": {**ACT, "max_instances": 1}})


def test_max_moves_is_one_unless_set_and_at_least_one():
    assert parse_config({**LISTED, "planner": ACT}, "c.yaml").planner.max_moves == 1
    assert error_of({**LISTED, "planner": {**ACT, "max_moves": 0}}).startswith(
        "c.yaml: bad value 0 for 'planner.max_moves'"
    )
