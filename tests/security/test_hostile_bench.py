"""python -m bench.micro.hostile against a live cluster: every attack refused with a 4xx or answered,
nothing restarted, the normal client never failed; a refusal comes at once; cached_tokens honest
for echo + logprobs."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from bench.micro import hostile
from tests.security.conftest import MAX_CONNECTIONS
from tests.support.cluster import REPO
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
# Attacks the cluster serves: the rest are refused with a 400.
ANSWERED = {"ambiguous n=16", "prompt over P's cache", "two greedy n=8", "4 x scored 4000", "n=16 logprobs answer"}


def router_connections_open(url: str) -> float:
    """The router's open client connections, this request's own among them (closed after it)."""
    metrics = httpx.get(f"{url}/metrics", headers={"connection": "close"}, timeout=10).text
    return next(
        float(line.split()[1]) for line in metrics.splitlines() if line.startswith("pdserve_router_connections_open ")
    )


def test_every_attack_is_answered_without_a_5xx_or_a_restart_and_the_victim_is_served(target):
    # The refusals below count on no other connection from this address: earlier tests' kept-alive ones go first.
    target.cluster.close_connections()
    wait_until(
        lambda: router_connections_open(target.cluster.router_url) == 1, 10, "the router's idle connections closed"
    )
    result = hostile.run(target.cluster.run_dir, None, baseline_s=2.0)
    rows = {r["attack"]: r for r in result["rows"]}
    assert set(rows) == {"(none: the client alone)", *(name for name, *_ in hostile.ATTACKS)}
    for name, _fields, copies, times in hostile.ATTACKS:
        row = rows[name]
        statuses = dict(row["statuses"])
        # This cluster lets one address hold MAX_CONNECTIONS connections: of 8 prompts sent at once beside
        # the victim's, those over it get a 503 and are closed before a byte is read (server_common/connections.py).
        refused = sum(
            statuses.pop(k)
            for k in (503, "RemoteProtocolError", "ConnectError", "ReadError", "WriteError")
            if k in statuses
        )
        assert refused <= max(0, copies + 1 - MAX_CONNECTIONS), row
        expected = 200 if name in ANSWERED else 400
        assert statuses == {expected: copies * times - refused}, row
        assert row["victim_failures"] == 0 and row["victim_requests"] > 0 and row["pids_unchanged"], row
        if name == "n=16 KV hog":  # refused by the router from what it knows, no server asked
            assert row["slowest_s"] < 1.0, row
    assert result["cached"] == {"cached_tokens": [0, 0], "decode_prefix_hits": 0.0}
    assert all(pid is not None for pid in result["pids"].values())
    print(hostile.report(result))
    target.cluster.wait_idle(10.0)
    assert all(b["free"] == b["total"] for b in target.cluster.blocks().values())


def test_help_and_a_folder_without_a_cluster(tmp_path):
    help_run = subprocess.run(
        [sys.executable, "-m", "bench.micro.hostile", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert help_run.returncode == 0 and "run_dir" in help_run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "bench.micro.hostile", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert bad.returncode == 2 and "no cluster.json" in bad.stderr
