"""What the soak samples from each process of a launched cluster, and what it makes of the samples.

Every interval, for each process ``cluster.json`` lists (read again each time: a restarted server
has a new pid): resident memory, open file descriptors and threads (psutil), and its own
bookkeeping: a server's ``GET /debug/bookkeeping`` (entries per map that grows with traffic, with
the internal secret), the router's request gauges from ``/metrics``. After the run, each process's
RSS slope after warm-up (least squares, MB per hour) against a bound, and whether the per-request
bookkeeping, the fds and the threads came back to their idle numbers once the load stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import psutil

# Entries that exist only while a request is in flight: 0 once the cluster is idle.
PER_REQUEST = frozenset(
    {
        # prefill server
        "jobs",
        "transfers",
        "pending",
        "sender_transfers",
        # decode server
        "active",
        "streams",
        "awaiting",
        "cancelling",
        "unfilled_claims",
        "receiver_transfers",
        # both
        "engine_requests",
        # router (its /metrics gauges)
        "inflight",
        "waiting",
        # the soak's own: a server that answered /debug/bookkeeping with an error
        "unreadable",
    }
)
ROUTER_GAUGES = {"pdserve_router_inflight_requests": "inflight", "pdserve_router_waiting_requests": "waiting"}


@dataclass
class Sample:
    t: float  # seconds since the soak started
    name: str
    pid: int
    rss_mb: float
    fds: int
    threads: int
    book: dict[str, int] = field(default_factory=dict)


def read_manifest(run_dir: Path) -> dict:
    """``RUN_DIR/cluster.json`` (rewritten atomically by the launcher on every restart)."""
    return json.loads((run_dir / "cluster.json").read_text())


def bookkeeping(http: httpx.Client, proc: dict, headers: dict[str, str]) -> dict[str, int]:
    """A server's ``/debug/bookkeeping`` sizes, or the router's request gauges; {} when it does not answer
    (down, restarting), ``{"unreadable": STATUS}`` when it answers with an error (counted as left over)."""
    try:
        if proc["role"] == "router":
            book = {}
            for line in http.get(proc["url"] + "/metrics").text.splitlines():
                key, _, value = line.rpartition(" ")
                if key in ROUTER_GAUGES:
                    book[ROUTER_GAUGES[key]] = int(float(value))
            return book
        resp = http.get(proc["url"] + "/debug/bookkeeping", headers=headers)
        return resp.json()["sizes"] if resp.status_code == 200 else {"unreadable": resp.status_code}
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


def sample(run_dir: Path, http: httpx.Client, headers: dict[str, str], t: float) -> list[Sample]:
    """One sample of every process the manifest lists now (a process gone between the two reads is left out)."""
    out = []
    for proc in read_manifest(run_dir)["processes"]:
        try:
            p = psutil.Process(proc["pid"])
            with p.oneshot():
                rss, fds, threads = p.memory_info().rss, p.num_fds(), p.num_threads()
        except psutil.Error:
            continue
        out.append(Sample(t, proc["name"], proc["pid"], rss / 1e6, fds, threads, bookkeeping(http, proc, headers)))
    return out


@dataclass(frozen=True)
class Slope:
    name: str
    pid: int
    mb_per_hour: float
    samples: int
    first_mb: float
    last_mb: float
    bound: float

    @property
    def verdict(self) -> str:
        if self.samples < 3:
            return "too few samples"
        return "flat" if self.mb_per_hour < self.bound else "growing"


def slopes(samples: list[Sample], warmup_s: float, bound: float) -> list[Slope]:
    """Per process: the least-squares RSS slope of its last pid's samples taken ``warmup_s`` after both the
    soak and that pid started (a restarted server warms up again)."""
    out = []
    for name in dict.fromkeys(s.name for s in samples):
        mine = [s for s in samples if s.name == name]
        pid = mine[-1].pid
        born = min(s.t for s in mine if s.pid == pid)
        start = max(warmup_s, born + warmup_s) if born > 0 else warmup_s
        kept = [s for s in mine if s.pid == pid and s.t >= start]
        if len(kept) >= 2:
            t = np.array([s.t for s in kept]) / 3600.0
            rss = np.array([s.rss_mb for s in kept])
            per_hour = float(np.polyfit(t, rss, 1)[0]) if t[-1] > t[0] else 0.0
        else:
            per_hour = 0.0
        first, last = (kept[0].rss_mb, kept[-1].rss_mb) if kept else (0.0, 0.0)
        out.append(Slope(name, pid, round(per_hour, 2), len(kept), round(first, 1), round(last, 1), bound))
    return out


def leftovers(samples: list[Sample]) -> dict[str, dict[str, int]]:
    """Per-request bookkeeping not back to 0 in these samples: {process: {key: entries}}."""
    out: dict[str, dict[str, int]] = {}
    for s in samples:
        left = {k: v for k, v in s.book.items() if k in PER_REQUEST and v}
        if left:
            out[s.name] = left
    return out


THREAD_SLACK = 2


def over_idle(
    samples: list[Sample], idle: list[Sample], warm: Sequence[Sample] = (), thread_slack: int = THREAD_SLACK
) -> dict[str, dict[str, tuple[int, int]]]:
    """Fds and threads above the idle numbers of the same pid: {process: {"fds": (idle, now), ...}}.

    Threads may stay at the most that ``warm`` (samples taken while the load warmed up) saw, plus
    ``thread_slack``: a worker pool grows on a burst and keeps its threads (asyncio's default executor, up
    to min(32, cores + 4), on the router and the servers), which is no leak; a thread per request or per
    transfer would pass any such slack within seconds."""
    before = {(s.name, s.pid): s for s in idle}
    ceiling = {key: s.threads for key, s in before.items()}
    for s in warm:
        if (s.name, s.pid) in ceiling:
            ceiling[(s.name, s.pid)] = max(ceiling[(s.name, s.pid)], s.threads)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for s in samples:
        base = before.get((s.name, s.pid))
        if base is None:
            continue
        over = {"fds": (base.fds, s.fds)} if s.fds > base.fds else {}
        if s.threads > ceiling[(s.name, s.pid)] + thread_slack:
            over["threads"] = (ceiling[(s.name, s.pid)], s.threads)
        if over:
            out[s.name] = over
    return out


def settle(
    run_dir: Path,
    http: httpx.Client,
    headers: dict[str, str],
    idle: list[Sample],
    t0: float,
    timeout_s: float,
    warm: Sequence[Sample] = (),
) -> tuple[list[Sample], dict, dict]:
    """Once the load stopped: sample until no per-request entry is left and fds and threads are back to
    ``idle`` (threads: or to what ``warm`` saw, ``over_idle``), or ``timeout_s`` passes; returns the last
    samples, the leftovers and what is over idle."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = sample(run_dir, http, headers, time.monotonic() - t0)
        left, over = leftovers(now), over_idle(now, idle, warm)
        if (not left and not over) or time.monotonic() > deadline:
            return now, left, over
        time.sleep(0.5)


def as_rows(samples: list[Sample]) -> list[dict]:
    return [asdict(s) for s in samples]
