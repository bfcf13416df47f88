"""What one hostile request costs everyone else: each attack sent to a live cluster while a
normal client streams, side by side with the same client alone, in one run.

    pdserve launch configs/tiny-1p1d.yaml        # or any cluster; then, with its run folder:
    python -m bench.micro.hostile RUN_DIR [--model NAME] [--baseline-s 10] [--json OUT]

A normal client streams short greedy completions one after another on a thread
and records each one's time to first token. It runs alone for ``--baseline-s``,
then beside each attack in turn:

    chained grammar        a Lark grammar of 3000 chained rules in guided_grammar, 5 times
    ambiguous n=16         'e: e e | "a"' with n 16
    anyOf 3000             a response_format JSON schema with 3000 anyOf branches
    deep guided_json       guided_json nested 3000 levels, as a JSON string
    8 x 4 MB prompts       eight ~4 MB text prompts at once
    forced grammar         'a: "?" a' (every token forces another), 5 times
    prompt over P's cache  a 2100-token prompt (tiny-1p1d's prefill server holds 2048), 3 times
    n=16 KV hog            a 2000-token prompt, n 16, max_tokens 2000, ignore_eos
    two greedy n=8         two 1000-token prompts, n 8, max_tokens 376, ignore_eos, at once
                           (each within half of tiny-1p1d's decode cache, both over all of it)
    4 x scored 4000        four 4000-token prompts with echo and logprobs at once
    2000 tools             a chat request with 2000 function tools (~3 MB), twice
    100k empty messages    a chat request of 100,000 empty user messages, twice
    n=16 logprobs answer   two sampled n 16 x 200-token answers with 20 top log-probabilities at once

``--only`` picks attacks by words of their names (``--only "KV hog,greedy"``).

For each it prints the statuses the attack got, its slowest answer, the normal
client's p99 time to first token, longest pause within a stream, and failures meanwhile, how long the router then
took to be ready again (before the next attack, which waits for it), whether every
process of the cluster kept its pid (``RUN_DIR/cluster.json``; a restarted one
gets a new pid), and the router's resident memory a second after the attack.
Then ``cached_tokens`` of an echo + logprobs prompt sent twice,
next to the decode servers' prefix-cache hits it caused. Traffic goes only to the
cluster's own router and servers (its config's addresses).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def token_ids(n: int) -> list[int]:
    """A prompt of ``n`` token ids, each in any vocabulary of over 500 tokens (tiny's has 512)."""
    return [10 + i % 490 for i in range(n)]


CHAINED = "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(2999)] + ['r2999: "a"'])
ATTACKS = (  # (name, request body fields, copies sent at once, times sent)
    ("chained grammar", {"guided_grammar": CHAINED}, 1, 5),
    ("ambiguous n=16", {"guided_grammar": 'start: e\ne: e e | "a"', "n": 16, "max_tokens": 8}, 1, 1),
    (
        "anyOf 3000",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"anyOf": [{"const": i} for i in range(3000)]}},
            }
        },
        1,
        1,
    ),
    ("deep guided_json", {"guided_json": '{"items":' * 3000 + '{"type":"integer"}' + "}" * 3000}, 1, 1),
    ("8 x 4 MB prompts", {"prompt": "lorem ipsum " * 340_000}, 8, 1),
    ("forced grammar", {"guided_grammar": 'start: a\na: "?" a'}, 1, 5),
    ("prompt over P's cache", {"prompt": token_ids(2100)}, 1, 3),
    ("n=16 KV hog", {"prompt": token_ids(2000), "n": 16, "max_tokens": 2000, "ignore_eos": True}, 1, 1),
    ("two greedy n=8", {"prompt": token_ids(1000), "n": 8, "max_tokens": 376, "ignore_eos": True}, 2, 1),
    ("4 x scored 4000", {"prompt": token_ids(4000), "echo": True, "logprobs": 1, "max_tokens": 1}, 4, 1),
    (
        "2000 tools",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": f"tool_{i}",
                        "description": "does things " * 100,
                        "parameters": {
                            "type": "object",
                            "properties": {f"arg{k}": {"type": "string"} for k in range(10)},
                        },
                    },
                }
                for i in range(2000)
            ],
        },
        1,
        2,
    ),
    ("100k empty messages", {"messages": [{"role": "user", "content": ""}] * 100_000}, 1, 2),
    (
        "n=16 logprobs answer",
        {"prompt": token_ids(10), "n": 16, "max_tokens": 200, "ignore_eos": True, "logprobs": 20, "temperature": 1.0},
        2,
        1,
    ),
)


class NormalClient:
    """Streamed greedy completions one after another; time to first token of each."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.ttft: list[tuple[float, float]] = []  # (start, seconds to the first token)
        self.gaps: list[tuple[float, float]] = []  # (start, longest pause between two events of its stream)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {
            "model": self.model,
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        }
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                first = last = None
                gap = 0.0
                try:
                    with http.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                now = time.monotonic()
                                if first is None:
                                    first = now - start
                                else:
                                    gap = max(gap, now - last)
                                last = now
                        if r.status_code != 200 or first is None:
                            self.failures.append(f"status {r.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(type(exc).__name__)
                    time.sleep(0.1)  # the router is down: count the failure, do not spin
                if first is not None:
                    self.ttft.append((start, first))
                    self.gaps.append((start, gap))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(180)

    def window(self, since: float, until: float) -> tuple[list[float], int]:
        """TTFTs of requests started in [since, until), and failures so far."""
        return [t for s, t in self.ttft if since <= s < until], len(self.failures)

    def longest_gap(self, since: float, until: float) -> float | None:
        """The longest pause within the stream of a request started in [since, until)."""
        return max((g for s, g in self.gaps if since <= s < until), default=None)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def pids(run_dir: Path) -> dict[str, int | None]:
    """Each process of the cluster's pid now (None: gone), from its manifest and /proc."""
    manifest = json.loads((run_dir / "cluster.json").read_text())
    return {p["name"]: p["pid"] if os.path.exists(f"/proc/{p['pid']}") else None for p in manifest["processes"]}


def router_rss_mb(run_dir: Path) -> float | None:
    """The router's resident memory now (MB), from /proc; None when it is not running."""
    manifest = json.loads((run_dir / "cluster.json").read_text())
    for p in manifest["processes"]:
        if p["role"] == "router":
            try:
                status = Path(f"/proc/{p['pid']}/status").read_text()
            except OSError:
                return None
            kb = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
            return int(kb) / 1024
    return None


def wait_ready(url: str, timeout: float = 120.0) -> float:
    """Seconds until the router's /health says ready (it may be restarting after an attack)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a restarting router
    return time.monotonic() - start


def request_of(model: str, fields: dict) -> tuple[str, bytes]:
    """An attack's path and body: a chat completion when ``fields`` has messages, else a completion.
    Encoded once, before the attack: encoding megabytes of JSON on this process's threads would hold
    the GIL from the normal client that measures the attack."""
    chat = "messages" in fields
    body = {"model": model, "max_tokens": 4, "temperature": 0} | ({} if chat else {"prompt": "x"}) | fields
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


def send(url: str, path: str, body: bytes) -> tuple[int, float]:
    start = time.monotonic()
    try:
        status = httpx.post(
            f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120
        ).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return status, time.monotonic() - start


def attack(url: str, model: str, fields: dict, copies: int, times: int) -> tuple[dict, float]:
    statuses: dict = {}  # status code (or the client's exception) -> count
    slowest = 0.0
    path, body = request_of(model, fields)
    with ThreadPoolExecutor(copies) as pool:
        for _ in range(times):
            for status, seconds in pool.map(lambda _: send(url, path, body), range(copies)):
                statuses[status] = statuses.get(status, 0) + 1
                slowest = max(slowest, seconds)
    return statuses, slowest


def prefix_hits(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("pdserve_prefix_cache_hits_tokens_total "):
                total += float(line.split()[1])
    return total


def cached_tokens_check(url: str, model: str, decode_urls: list[str]) -> dict:
    """An echo + logprobs prompt of 65 tokens' worth of text sent twice: what usage says was cached,
    next to the prefix-cache hits the decode servers counted meanwhile."""
    body = {
        "model": model,
        "prompt": " ".join(f"w{i}" for i in range(40)),
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
    }
    before = prefix_hits(decode_urls)
    cached = [
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        for _ in range(2)
    ]
    return {"cached_tokens": cached, "decode_prefix_hits": prefix_hits(decode_urls) - before}


def run(run_dir: Path, model: str | None, baseline_s: float, only: list[str] | None = None) -> dict:
    manifest = json.loads((run_dir / "cluster.json").read_text())
    url, model = manifest["router_url"], model or manifest["model"]
    decode_urls = [p["url"] for p in manifest["processes"] if p["role"] in ("decode", "colocated")]
    start_pids = pids(run_dir)
    normal = NormalClient(url, model)
    normal.start()
    rows = []
    try:
        t0 = time.monotonic()
        time.sleep(baseline_s)  # the normal client alone: the baseline it is compared with
        alone, _ = normal.window(t0, time.monotonic())
        rows.append(
            {
                "attack": "(none: the client alone)",
                "router_down_s": 0.0,
                "statuses": {},
                "slowest_s": None,
                "victim_requests": len(alone),
                "victim_p99_ttft_s": p99(alone),
                "victim_failures": 0,
                "victim_longest_gap_s": normal.longest_gap(t0, time.monotonic()),
                "pids_unchanged": pids(run_dir) == start_pids,
                "router_rss_mb": router_rss_mb(run_dir),
            }
        )
        for name, fields, copies, times in ATTACKS:
            if only and not any(word.lower() in name.lower() for word in only):
                continue
            wait_ready(url)  # each attack meets a serving router, even if the last one took it down
            since, (_, failed_before) = time.monotonic(), normal.window(0, 0)
            statuses, slowest = attack(url, model, fields, copies, times)
            time.sleep(1.0)  # the victim's requests started during the attack finish in the window
            during, failed = normal.window(since, time.monotonic())
            down_s = wait_ready(url)
            rows.append(
                {
                    "attack": name,
                    "router_down_s": down_s,
                    "statuses": statuses,
                    "slowest_s": slowest,
                    "victim_requests": len(during),
                    "victim_p99_ttft_s": p99(during),
                    "victim_longest_gap_s": normal.longest_gap(since, time.monotonic()),
                    "victim_failures": failed - failed_before,
                    "pids_unchanged": pids(run_dir) == start_pids,
                    "router_rss_mb": router_rss_mb(run_dir),
                }
            )
    finally:
        normal.stop()
    return {"rows": rows, "cached": cached_tokens_check(url, model, decode_urls), "pids": pids(run_dir)}


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def report(result: dict) -> str:
    lines = [
        "| attack | its answers | slowest | victim requests | victim p99 TTFT | victim longest gap | "
        "victim failures | router not ready after | pids unchanged | router RSS after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        answers = ", ".join(f"{n} x {s}" for s, n in r["statuses"].items()) or "-"
        lines.append(
            f"| {r['attack']} | {answers} | {fmt(r['slowest_s'])} | {r['victim_requests']} | "
            f"{fmt(r['victim_p99_ttft_s'])} | {fmt(r['victim_longest_gap_s'])} | {r['victim_failures']} | "
            f"{r['router_down_s']:.1f} s | {r['pids_unchanged']} | {mb(r['router_rss_mb'])} |"
        )
    c = result["cached"]
    lines.append(
        f"\necho + logprobs sent twice: cached_tokens {c['cached_tokens']}, decode prefix-cache hits "
        f"meanwhile {c['decode_prefix_hits']:g} tokens"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.hostile",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="the run folder of a `pdserve launch` (holds cluster.json)")
    parser.add_argument("--model", help="the served model name (default: the manifest's)")
    parser.add_argument("--baseline-s", type=float, default=10.0, help="seconds of the normal client alone")
    parser.add_argument(
        "--only",
        type=lambda s: [w.strip() for w in s.split(",") if w.strip()],
        help="comma-separated words: only the attacks whose names contain one",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not (args.run_dir / "cluster.json").is_file():
        parser.error(f"{args.run_dir}: no cluster.json (the run folder `pdserve launch` printed)")
    result = run(args.run_dir, args.model, args.baseline_s, args.only)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
