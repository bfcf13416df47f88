"""What the processes say while serving: the router's access log, every process's stats line, and
the launcher echoing the stats lines (router/access_log.py, server_common/stats_log.py)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from deploy.launcher import StatsEcho
from router.access_log import AccessLog
from server_common.stats_log import RouterSnapshot, ServerSnapshot, router_line, server_line
from tests.support.cluster import Cluster, make_config
from tests.support.oracle import expected_completion
from tests.waiting import wait_until


def snap(at, **kw) -> ServerSnapshot:
    fields = dict(
        running=0,
        waiting=0,
        blocks_held=0,
        blocks_total=200,
        prompt_tokens=0,
        decode_tokens=0,
        prefix_queried=0,
        prefix_hits=0,
        transfers=0,
        preemptions=0,
    )
    return ServerSnapshot(at, **(fields | kw))


def test_a_server_s_stats_line_covers_the_interval_and_says_nothing_when_idle():
    before = snap(0.0, prompt_tokens=100, decode_tokens=10, prefix_queried=40, prefix_hits=10, transfers=3)
    now = snap(
        2.0,
        running=3,
        waiting=1,
        blocks_held=25,
        prompt_tokens=1724,
        decode_tokens=202,
        prefix_queried=140,
        prefix_hits=43,
        transfers=11,
        preemptions=1,
    )
    assert server_line("d0", before, now) == (
        "stats d0: running 3, waiting 1; KV 12.5% used; prompt 812.0 tok/s, generation 96.0 tok/s; "
        "prefix-cache hits 33%; transfers 4.0/s; preemptions 1"
    )
    assert (
        server_line(
            "d0",
            now,
            snap(
                4.0,
                prompt_tokens=1724,
                decode_tokens=202,
                prefix_queried=140,
                prefix_hits=43,
                transfers=11,
                preemptions=1,
            ),
        )
        is None
    )


def test_the_router_s_stats_line():
    before = RouterSnapshot(10.0, 4, 0, 0, 100, 50, 2, 2)
    assert router_line(before, RouterSnapshot(15.0, 14, 3, 1, 600, 300, 1, 2)) == (
        "stats router: requests 2.0/s, streams open 3, queued 1; prompt 100.0 tok/s, generation 50.0 tok/s; "
        "workers in rotation 1/2"
    )
    assert router_line(before, RouterSnapshot(15.0, 4, 0, 0, 100, 50, 2, 2)) is None


def test_the_access_log_says_each_request_once(caplog):
    access = AccessLog()
    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        access.served("r1", "chat", "ok", 12, 8, 0.045, 0.16, "p0", "d0")
        access.refused("r1", "chat", 502, "stream_cut")  # its timeline already said how it ended
        access.refused("r2", "completions", 400, "context_length_exceeded")
        AccessLog(enabled=False).served("r3", "chat", "ok", 1, 1, None, 0.1, "local", "d0")
    assert [r.getMessage() for r in caplog.records] == [
        "access r1 chat ok prompt=12 completion=8 ttft=45ms total=160ms prefill=p0 decode=d0",
        "access r2 completions 400 context_length_exceeded",
    ]


def test_the_launcher_echoes_only_whole_stats_lines_prefixed(tmp_path: Path, capsys):
    class Proc:
        def __init__(self, name):
            self.name, self.log = name, tmp_path / f"{name}.log"
            self.log.write_text("2026-12-03 old pdserve.stats: stats before the launch\n")

    class Cluster:
        procs = [Proc("d0"), Proc("router")]

    echo = StatsEcho(Cluster(), stop=None)
    with open(tmp_path / "d0.log", "a") as f:
        f.write(
            "t d0 INFO pdserve.stats: stats d0: running 1\nt d0 INFO uvicorn: GET /health\n"
            "t d0 INFO pdserve.stats: stats d0: runn"
        )
    echo.poll()
    with open(tmp_path / "d0.log", "a") as f:
        f.write("ing 2\n")
    with open(tmp_path / "router.log", "a") as f:
        f.write("t router INFO pdserve.stats: stats router: requests 1.0/s\n")
    echo.poll()
    assert capsys.readouterr().out.splitlines() == [
        "d0 | stats d0: running 1",
        "d0 | stats d0: running 2",
        "router | stats router: requests 1.0/s",
    ]


def test_the_launcher_s_stats_echo_stops_when_told_and_joins(tmp_path: Path):
    class Proc:
        name, log = "d0", tmp_path / "d0.log"

    class Cluster:
        procs = [Proc()]

    stop = threading.Event()
    echo = StatsEcho(Cluster(), stop, interval_s=0.01)
    echo.start()
    stop.set()
    echo.join(10)  # its stop event must not shadow Thread._stop, which join() calls
    assert not echo.is_alive()


@pytest.mark.integration
def test_a_launched_cluster_logs_each_request_and_its_stats(tmp_path, tiny_model):
    cluster = Cluster(make_config(tmp_path, "tiny-1p1d", tiny_model, {"log_stats_interval_s": 0.5}), tmp_path)
    try:
        client = cluster.client(timeout=60)
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
        assert out.choices[0].text == expected_completion(tiny_model, "hello", 4)[0]
        refused = cluster.http.post(f"{cluster.router_url}/v1/completions", json={"model": "other", "prompt": "x"})
        assert refused.status_code == 404
        router_log = tmp_path / "router.log"
        wait_until(lambda: " 404 model_not_found" in router_log.read_text(), 10, "the refusal's access line")
        lines = [line for line in router_log.read_text().splitlines() if "pdserve.access: access" in line]
        assert len(lines) == 2, lines
        assert " completions ok prompt=1 completion=4 ttft=" in lines[0] and lines[0].endswith(" prefill=p0 decode=d0")
        assert " completions 404 model_not_found" in lines[1]
        launcher = tmp_path / "launcher.log"
        said = launcher.read_text()  # what it said while starting: no long silence
        assert "pdserve: starting p0 (prefill), d0 (decode): each loads the model" in said
        assert all(f"pdserve: {who} ready (" in said for who in ("prefill p0", "decode d0", "router"))
        for name in ("router", "d0", "p0"):
            wait_until(
                lambda name=name: f"{name} | stats {name}: " in launcher.read_text(), 10, f"{name}'s stats echoed"
            )
    finally:
        cluster.stop()
