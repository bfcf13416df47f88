"""The abusers of issue 32's items 1-5 all at once against a real 1P2D, while normal clients stream:
a prompt longer than the prefill server's cache, a request needing more KV than its share, 100,000
empty messages and 2000 tools, a frozen decode server (SIGSTOP), and strangers piling up slow
connections on the router and on a decode server. No normal answer is wrong, none hangs, no block
leaks. The frozen server goes first: what it holds ends within the stall time, and once it is out of
rotation (still frozen) the rest begin, during which the normal clients' p99 time to first token stays
within twice what it is alone (plus one second: two shared cores run the abusers that are served;
every stall this guards against was 5 to 17 s)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.support.cluster import Cluster, make_config
from tests.support.oracle import expected_completion
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
STALL_S = 3
P_BLOCKS = 64  # of 16 tokens: p0 holds 1024
PROMPT = "The capital of France is"
MAX_TOKENS = 8
WINDOW = 30  # normal requests finished in each window: alone, then during the abuse


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    folder = tmp_path_factory.mktemp("everyone")
    path = make_config(
        folder,
        "1p2d",
        tiny_model,
        {
            "lease_s": 10,
            "router": {"stream_stall_s": STALL_S, "header_timeout_s": 2, "max_connections_per_client": 16},
            "security": {"server_header_timeout_s": 4, "server_max_connections": 64, "server_reserved_connections": 16},
        },
        instances={"p0": {"num_blocks": P_BLOCKS}},
    )
    cluster = Cluster(path, folder)
    yield cluster
    cluster.stop()


class NormalClient(threading.Thread):
    """Streams greedy completions one after another: (start, end, TTFT, longest gap, text or error) each."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done: list[tuple[float, float, float | None, float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                start, first, last, gap, text = time.monotonic(), None, None, 0.0, ""
                try:
                    with http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            event, now = json.loads(line[len("data: ") :]), time.monotonic()
                            if "error" in event:
                                text = f"error: {event['error']['message']}"
                                break
                            first = first if first is not None else now - start
                            gap = max(gap, now - last) if last is not None else 0.0
                            last = now
                            text += event["choices"][0]["text"]
                        if r.status_code != 200:
                            text = f"error: status {r.status_code}"
                except httpx.TimeoutException:
                    text = "hung"
                except httpx.HTTPError as exc:
                    text = f"error: {exc!r}"
                self.done.append((start, time.monotonic(), first, gap, text))

    def window(self, since: float, until: float) -> list[tuple[float, float, float | None, float, str]]:
        """Requests that ended in [since, until)."""
        return [d for d in self.done if since <= d[1] < until]


def router_view(url: str, name: str) -> dict:
    return next(w for w in httpx.get(f"{url}/health", timeout=10).json()["workers"] if w["name"] == name)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def timed_post(url: str, path: str, body: dict, out: list, timeout: float = 60) -> None:
    start = time.monotonic()
    try:
        status = httpx.post(f"{url}{path}", json=body, timeout=timeout).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    out.append((status, time.monotonic() - start))


def pile_up(url: str, count: int, first_address: int) -> list[socket.socket]:
    """Strangers' connections from 127.0.0.N on, sending half a request line and nothing more."""
    target = httpx.URL(url)
    socks = []
    for i in range(count):
        sock = socket.socket()
        sock.bind((f"127.0.0.{first_address + i % 8}", 0))
        try:
            sock.connect((target.host, target.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        except OSError:
            sock.close()  # refused or reset: the server's cap did its work
            continue
        socks.append(sock)
    return socks


def test_every_abuser_at_once_costs_the_normal_clients_nothing_wrong_hung_or_leaked(cluster, tiny_model):
    expected = expected_completion(tiny_model, PROMPT, MAX_TOKENS)[0]
    url, d0, d1 = cluster.router_url, cluster.server("d0"), cluster.server("d1")
    clients = [NormalClient(url) for _ in range(2)]
    for c in clients:
        c.start()
    abusers: dict[str, list] = {name: [] for name in ("over_p_cache", "kv_hog", "messages", "tools")}
    socks: list[socket.socket] = []
    frozen = False
    try:
        started = time.monotonic()
        finished = lambda since: sum(len(c.window(since, time.monotonic())) for c in clients)  # noqa: E731
        wait_until(lambda: finished(started) >= 6, 60, "the normal clients warmed up")
        t0 = time.monotonic()
        wait_until(lambda: finished(t0) >= WINDOW, 60, "the normal clients' requests alone")
        # The frozen decode server first: until it leaves rotation (stream_stall_s) the requests it holds
        # wait, which no bound but the stall time can cover (migration, issue 29, will). It stays frozen.
        t1 = time.monotonic()
        os.kill(d1["pid"], signal.SIGSTOP)
        frozen = True
        wait_until(lambda: not router_view(url, "d1")["in_rotation"], STALL_S + 30, "d1 out of rotation")
        wait_until(
            lambda: (
                all(c.done and c.done[-1][1] > time.monotonic() - 0.5 for c in clients)
                and finished(time.monotonic() - 0.5) >= 2
            ),
            30,
            "every normal client past the freeze",
        )
        t2 = time.monotonic()
        ids = lambda n: [10 + i % 490 for i in range(n)]  # noqa: E731
        threads = [
            threading.Thread(target=timed_post, args=args, daemon=True)
            for args in [
                (
                    url,
                    "/v1/completions",
                    {"model": "tiny", "prompt": ids(1100), "max_tokens": 2, "temperature": 0},
                    abusers["over_p_cache"],
                ),
                (
                    url,
                    "/v1/completions",
                    {"model": "tiny", "prompt": ids(2000), "n": 16, "max_tokens": 2000, "ignore_eos": True},
                    abusers["kv_hog"],
                ),
                (
                    url,
                    "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": ""}] * 100_000},
                    abusers["messages"],
                ),
                (
                    url,
                    "/v1/chat/completions",
                    {
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "hi"}],
                        "tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(2000)],
                    },
                    abusers["tools"],
                ),
            ]
        ]
        for t in threads:
            t.start()
        socks = pile_up(url, 48, 2) + pile_up(d0["url"], 64, 20)
        for t in threads:
            t.join(60)
        # d1 stays frozen and the strangers' connections open until the window is full.
        wait_until(lambda: finished(t2) >= WINDOW, 90, "the normal clients' requests during the abuse")
        t3 = time.monotonic()
    finally:
        if frozen:
            os.kill(d1["pid"], signal.SIGCONT)
        for sock in socks:
            sock.close()
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(60)
    alone = [d for c in clients for d in c.window(t0, t1)]
    onset = [d for c in clients for d in c.window(t1, t2)]
    during = [d for c in clients for d in c.window(t2, t3)]
    served = lambda ds: [d for d in ds if d[2] is not None and not d[4].startswith(("error", "hung"))]  # noqa: E731
    ok_alone, ok_onset, ok_during = served(alone), served(onset), served(during)
    failed = [d for d in onset if d not in ok_onset]
    alone_p99, during_p99 = p99([d[2] for d in ok_alone]), p99([d[2] for d in ok_during])
    print(
        f"normal clients alone: {len(alone)} requests, p99 TTFT {alone_p99 * 1000:.0f} ms, longest gap "
        f"{max(d[3] for d in ok_alone) * 1000:.0f} ms; while d1 froze and left rotation: {len(onset)}, the "
        f"longest {max(d[1] - d[0] for d in onset):.1f} s, {len(failed)} failed ({[d[4][:80] for d in failed]}); "
        f"during the abuse: {len(during)}, p99 TTFT {during_p99 * 1000:.0f} ms, longest gap "
        f"{max(d[3] for d in ok_during) * 1000:.0f} ms; abusers (status, seconds): {abusers}"
    )
    assert all(d[4] == expected for d in ok_alone + ok_onset + ok_during)  # 0 wrong
    assert not [d for d in alone + onset + during if d[4] == "hung"]  # 0 hung
    assert len(ok_alone) == len(alone) and len(ok_during) == len(during) >= WINDOW
    # What the frozen d1 held ended (served elsewhere, or a clear error naming it) within the stall time.
    assert all(d[1] - d[0] < STALL_S + 5 for d in onset) and all("d1" in d[4] for d in failed), onset
    assert during_p99 <= 2 * alone_p99 + 1.0
    assert abusers["kv_hog"][0][0] == 400 and abusers["messages"][0][0] == 400 and abusers["tools"][0][0] == 400
    assert max(abusers[name][0][1] for name in ("kv_hog", "messages", "tools")) < 2.0
    assert abusers["over_p_cache"][0][0] in (200, 502, 503)  # served on d0, or d1's clear error
    wait_until(lambda: router_view(url, "d1")["in_rotation"], 30, "d1 back in rotation")
    cluster.wait_idle(15.0)
    assert all(b["free"] == b["total"] for b in cluster.blocks().values()), cluster.blocks()  # 0 leaked
