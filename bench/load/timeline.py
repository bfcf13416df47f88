"""Where each request's time went, from the servers' own timings.

After a ``bench serve`` run, ``--timeline PNG`` fetches ``/debug/timeline``
from the router and from every worker the router lists on ``/health``
(server_common/timeline_log.py), joins them by request id (the router's
``X-Request-Id``, which the servers use too) and draws one bar per request,
cut into stages:

    router wait        arrival at the router -> the decode server starts the reservation
    reservation        the decode server reserves blocks -> the router has the reservation
    prefill queue      the prefill server has the prompt -> its first chunk is computed
    prefill compute    first chunk -> first token sampled (all layers computed)
    KV after compute   first token sampled -> the decode server verified the KV
    prefill on D       no prefill server (colocated, a short or cached prompt): the decode server has the
                       request -> first token (instead of reservation, prefill and KV stages)
    decode             KV verified (or the first token, prefilled on D) -> last token

Gaps between stages (the router handing the prompt to the prefill server)
stay blank. The summary names the stage that took the most time over all
requests. Clocks: the processes stamp Unix time, so they must share a
clock (one machine, or synchronised hosts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

STAGES = (
    "router wait",
    "reservation",
    "prefill queue",
    "prefill compute",
    "KV after compute",
    "prefill on D",
    "decode",
)
COLORS = ("#9e9e9e", "#8d6e63", "#ffb74d", "#e65100", "#7b1fa2", "#c62828", "#1976d2")


@dataclass(frozen=True)
class RequestStages:
    request_id: str
    arrived: float  # Unix time at the router
    stages: tuple[tuple[str, float, float], ...]  # (stage, start, end), Unix time


def fetch(router_url: str, headers: dict | None = None, timeout: float = 10.0) -> dict[str, list[dict]]:
    """Timelines by role: {"router": [...], "decode": [...], "prefill": [...]} (colocated counts as decode).
    Raises ValueError, one line naming the process, when one refuses (see ``check_access``)."""
    out: dict[str, list[dict]] = {"router": [], "decode": [], "prefill": []}
    with httpx.Client(timeout=timeout, headers=headers or {}) as http:
        out["router"] = _timeline(http, "the router", router_url)
        for worker in http.get(f"{router_url}/health").json()["workers"]:
            side = "prefill" if worker["role"] == "prefill" else "decode"
            out[side] += _timeline(http, worker["name"], worker["url"])
    return out


def check_access(router_url: str, headers: dict | None = None, timeout: float = 10.0) -> None:
    """Before a benchmark whose timeline is wanted: ValueError now, not after the run, if any process
    refuses its /debug/timeline."""
    fetch(router_url, headers, timeout)


def _timeline(http: httpx.Client, who: str, url: str) -> list[dict]:
    try:
        resp = http.get(f"{url}/debug/timeline")
    except httpx.HTTPError as exc:
        raise ValueError(f"{who} at {url} did not answer /debug/timeline ({exc!r})") from None
    if resp.status_code != 200:
        raise ValueError(
            f"{who} answered /debug/timeline with HTTP {resp.status_code}: the timeline needs the "
            "cluster's internal secret (--internal-secret-file, or --run-dir of its launch)"
        )
    return resp.json()["requests"]


def join(timelines: dict[str, list[dict]], request_ids: list[str] | None = None) -> list[RequestStages]:
    """One ``RequestStages`` per router request (only ``request_ids`` when given), by arrival."""
    decode = {e["request_id"]: e for e in timelines["decode"]}
    prefill = {e["request_id"]: e for e in timelines["prefill"]}
    wanted = set(request_ids) if request_ids is not None else None
    out = []
    for r in timelines["router"]:
        rid = r["request_id"]
        if (wanted is not None and rid not in wanted) or "last_token" not in r:
            continue
        d, p = decode.get(rid, {}), prefill.get(rid, {})
        remote = bool(p) or "kv_arrived" in d
        points = {
            "router wait": (r["arrived"], d.get("reserved", r.get("opened"))),
            "reservation": (d.get("reserved"), r.get("opened")) if remote else (None, None),
            "prefill queue": (p.get("received"), p.get("computing")),
            "prefill compute": (p.get("computing"), p.get("prefilled")),
            "KV after compute": (p.get("prefilled"), d.get("kv_arrived")),
            "prefill on D": (None, None) if remote else (d.get("reserved"), d.get("first_token")),
            "decode": (d.get("kv_arrived") or d.get("first_token") or r.get("opened"), r["last_token"]),
        }
        stages = tuple((name, a, b) for name, (a, b) in points.items() if a is not None and b is not None and b >= a)
        out.append(RequestStages(rid, r["arrived"], stages))
    return sorted(out, key=lambda s: s.arrived)


def totals(requests: list[RequestStages]) -> dict[str, float]:
    """Seconds spent in each stage, over all requests."""
    out = dict.fromkeys(STAGES, 0.0)
    for req in requests:
        for name, a, b in req.stages:
            out[name] += b - a
    return out


def dominant(requests: list[RequestStages]) -> tuple[str, float]:
    """The stage with the most time over all requests, and its share of all staged time."""
    t = totals(requests)
    name = max(t, key=t.get)
    return name, t[name] / max(sum(t.values()), 1e-12)


def summary_line(requests: list[RequestStages]) -> str:
    if not requests:
        return "timeline: no request of this run was found in the servers' timelines"
    name, share = dominant(requests)
    t = totals(requests)
    parts = ", ".join(f"{k} {v / len(requests) * 1000:.0f} ms" for k, v in t.items() if v > 0)
    return f"timeline: dominant stage {name} ({share:.0%} of staged time); mean per request: {parts}"


def plot(requests: list[RequestStages], path: str | Path, title: str = "") -> Path:
    """One horizontal bar per request (by arrival), stages in colour, time from the first arrival."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = min((r.arrived for r in requests), default=0.0)
    fig, ax = plt.subplots(figsize=(11, max(3.0, 0.22 * len(requests) + 1.5)))
    color = dict(zip(STAGES, COLORS))
    for y, req in enumerate(requests):
        for name, a, b in req.stages:
            ax.broken_barh([(a - t0, b - a)], (y - 0.4, 0.8), facecolors=color[name])
    ax.set_xlabel("seconds since the first request arrived")
    ax.set_ylabel("request (by arrival)")
    ax.set_ylim(-1, max(len(requests), 1))
    ax.invert_yaxis()
    head = "no request found"
    if requests:
        name, share = dominant(requests)
        head = f"dominant stage: {name} ({share:.0%} of staged time)"
    ax.set_title(f"{title}\n{head}" if title else head, fontsize=10)
    t = totals(requests)
    n = max(len(requests), 1)
    ax.legend(
        handles=[Patch(color=c, label=f"{s}: mean {t[s] / n * 1000:.0f} ms") for s, c in zip(STAGES, COLORS)],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
