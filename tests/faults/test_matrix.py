"""The fault matrix: {kill -9 prefill, kill -9 decode, drop the
completion notice, delay it past the lease, corrupt one block in transit,
client disconnect} x {before prefill starts, mid-transfer, after the first
token} x {1P1D, 2P2D}, each with a burst of concurrent requests in flight.

In every cell: every request ends with transformers' greedy answer or a clear
error within lease + margin (or was hung up on purpose), no wrong 200;
afterwards every live server has free == total blocks and the router answers
a new request correctly. The two layouts use different recovery settings so
that both sides of each choice run: 1P1D prefills locally (router and lease
expiry), 2P2D retries on the other prefill server and re-prefills on D after a
checksum failure.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.cells import FAULTS, MARGIN_S, STAGES, run_cell
from tests.faults.harness import FaultCluster, fault_config

pytestmark = pytest.mark.integration

COMMON = {
    "lease_s": 2.0,
    "router": {"health_interval_s": 0.5, "health_backoff_max_s": 1.0, "prefill_timeout_s": 30},
    "transfer": {"timeout_s": 5.0},
}
LAYOUTS = {
    "1P1D": (1, 1, {"recovery": {"prefill_failure": "local", "lease_expiry": "local", "checksum_failure": "fail"}}),
    "2P2D": (2, 2, {"recovery": {"prefill_failure": "retry", "lease_expiry": "fail", "checksum_failure": "local"}}),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tmp_path_factory, tiny_model):
    num_p, num_d, changes = LAYOUTS[request.param]
    folder = tmp_path_factory.mktemp(f"faults-{request.param}")
    c = FaultCluster(fault_config(folder, tiny_model, num_p, num_d, {**COMMON, **changes}), folder)
    c.layout = request.param
    yield c
    c.stop()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fault", FAULTS)
def test_every_request_ends_right_and_no_block_leaks(cluster, fault, stage, expected, matrix):
    result = asyncio.run(run_cell(cluster, cluster.layout, fault, stage, expected))
    matrix.append(result.row())
    wrong = [o for o in result.outcomes if o.kind == "wrong"]
    assert not wrong, wrong
    assert result.leaked == 0
    assert result.router_ok
    slow = [o for o in result.outcomes if o.kind != "left" and o.seconds > cluster.lease_s + MARGIN_S]
    assert not slow, slow
    assert result.fault_seen, result.evidence
