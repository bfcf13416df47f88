"""Kill -9 of one of two routers under load: what streamed chat clients lose, and whether background
responses resumed on the other router are whole (issue 48, Measure, first bullet).

    python -m bench.micro.router_failover [--clients 4] [--background 8] [--chat-tokens 24] \\
        [--tokens 64] [--step-delay-s 0.04] [--kill-after-deltas 6] [--json FILE] [--run-dir DIR]

``pdserve launch`` (bench/load/cluster.py) starts the built-in tiny model as 1P1D with two routers
(``router.replicas: 2``) behind the HAProxy front, their response store one SQLite file in the run
folder, and router restarts held off past the run, so that after the kill every request the front
takes goes to the router left. Before any load, each prompt is answered once through the front,
uninterrupted: the reference every later text must equal (greedy, so one run is every run). The decode
server then waits ``--step-delay-s`` after each step (its fault injection), so that generations last
long enough to be cut.

The load: ``--clients`` threads send streamed chat completions through the front, one after another
(``--chat-tokens`` each, ``ignore_eos``); ``--background`` background responses (``--tokens`` output
tokens, greedy) are made on router-0 itself and each read as a stream from router-0. Once every one of
those streams has ``--kill-after-deltas`` text deltas, router-0 gets SIGKILL (its pid from the run
folder's cluster.json). Each background reader then resumes on router-1 with ``GET
/v1/responses/{id}?stream=true&starting_after=N``, N the last event it read, and reads to the end.

Reported: chat streams cut by the kill (they cannot be saved), chat requests begun after it that
succeeded or failed, and chat texts unlike the reference; per background response, events lost or
duplicated across the seam (each sequence number once, in order, to the closing event), texts unlike
the reference, the final status, and the time from the kill to the first event router-0 had not logged
(router-1 adopts a response once its lease lapses, router/api/background.py ``LEASE_S``); router-1's
``pdserve_router_background_adoptions_total``; and the KV blocks still held on the servers once idle
(must be 0). One run, one machine: the times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.load.chaos import held_blocks, wait_for
from bench.load.cluster import RunningCluster, cpu_list, free_port_pairs, free_ports, launch

CHAT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "A prefill server computes the prompt; a decode server streams the answer.",
    "Numbers one to ten: 1 2 3 4 5 6 7 8 9 10, and then what comes next?",
    "Once upon a time there was a small model that wanted to serve many users at once",
]
ADOPTIONS = "pdserve_router_background_adoptions_total"
TERMINAL = ("response.completed", "response.failed", "response.incomplete", "response.cancelled")
NO_RESTART_S = 3600.0  # router-0 stays down for the whole run: the front has one router left


def background_question(i: int) -> str:
    return f"Write a long story about the sea, number {i}."


# ---- pure parts: events, the seam check, the report ---------------------------------------------------


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON payloads of a Server-Sent Events stream's ``data:`` lines (``[DONE]`` ends it)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


@dataclass
class SeamCheck:
    """What a client read of one response's event stream, across the seam: ``lost`` sequence numbers
    missing before the closing event, ``duplicated`` ones read more than once, whether they came in
    order, and whether the stream reached a closing event."""

    lost: int
    duplicated: int
    in_order: bool
    closed: bool


def check_sequence(events: list[dict]) -> SeamCheck:
    """Every event once, in order, from 0 to the closing one: the Responses API's ``sequence_number``."""
    seqs = [e["sequence_number"] for e in events]
    closed = bool(events) and events[-1].get("type") in TERMINAL
    end = seqs[-1] + 1 if closed else max(seqs, default=-1) + 1
    distinct = set(seqs)
    return SeamCheck(
        lost=len(set(range(end)) - distinct),
        duplicated=len(seqs) - len(distinct),
        in_order=seqs == sorted(distinct) and len(seqs) == len(distinct),
        closed=closed,
    )


def response_text(events: list[dict]) -> str:
    """The text of a response's ``response.output_text.delta`` events."""
    return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")


def output_text(response: dict) -> str:
    """A Responses API object's text (what the SDK's ``output_text`` joins)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


def metric_value(text: str, name: str) -> float | None:
    """The value of the unlabelled sample ``name`` in a Prometheus text exposition."""
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return None


@dataclass
class Reference:
    """A background request's answer run once, uninterrupted: its text and its final status (``incomplete``
    when it stopped at ``max_output_tokens``, as OpenAI's)."""

    text: str
    status: str


@dataclass
class ChatOutcome:
    """One streamed chat completion: ``ok`` (to ``[DONE]``), ``failed`` (an error status, an error event,
    a connection error or a cut stream), or ``wrong`` (to the end, another text than the reference)."""

    kind: str
    started: float
    ended: float


@dataclass
class BackgroundOutcome:
    """One background response as its client read it: the events from router-0 before the kill, those
    from router-1 after (each with the monotonic time it came), how many router-0 had logged at its
    death, and the status router-1 gives at the end."""

    response_id: str
    before: list[dict] = field(default_factory=list)
    after: list[tuple[float, dict]] = field(default_factory=list)
    logged_at_kill: int = 0
    status: str = ""
    error: str = ""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def summarize_chat(outcomes: list[ChatOutcome], killed_at: float) -> dict:
    """The chat load split at the kill: streams in flight when it came, requests begun after it."""
    hit = [o for o in outcomes if o.started <= killed_at < o.ended]
    after = [o for o in outcomes if o.started > killed_at]
    return {
        "requests": len(outcomes),
        "in_flight_at_kill": len(hit),
        "failed_in_flight_at_kill": sum(o.kind == "failed" for o in hit),
        "begun_after_kill": len(after),
        "ok_after_kill": sum(o.kind == "ok" for o in after),
        "failed_after_kill": sum(o.kind == "failed" for o in after),
        "failed_total": sum(o.kind == "failed" for o in outcomes),
        "wrong_texts": sum(o.kind == "wrong" for o in outcomes),
    }


def summarize_background(outcomes: list[BackgroundOutcome], references: list[Reference], killed_at: float) -> dict:
    """Per response: the seam check over what the client read from both routers, its text and final status
    against the reference's, and the seconds from the kill to its first event router-0 had not logged."""
    rows: list[dict] = []
    firsts: list[float] = []
    for outcome, reference in zip(outcomes, references, strict=True):
        events = outcome.before + [e for _, e in outcome.after]
        check = check_sequence(events)
        new = [t - killed_at for t, e in outcome.after if e["sequence_number"] >= outcome.logged_at_kill]
        firsts += new[:1]
        rows.append(
            {
                "id": outcome.response_id,
                "read_before_kill": len(outcome.before),
                "cut_by_kill": not (outcome.before and outcome.before[-1].get("type") in TERMINAL),
                "logged_at_kill": outcome.logged_at_kill,
                "events": len(events),
                "lost": check.lost,
                "duplicated": check.duplicated,
                "in_order": check.in_order,
                "closed": check.closed,
                "text_ok": response_text(events) == reference.text,
                "status": outcome.status,
                "status_ok": outcome.status == reference.status,
                "error": outcome.error,
                "kill_to_first_new_s": new[0] if new else None,
            }
        )
    return {
        "responses": len(rows),
        "cut_by_kill": sum(r["cut_by_kill"] for r in rows),
        "lost_events": sum(r["lost"] for r in rows),
        "duplicated_events": sum(r["duplicated"] for r in rows),
        "out_of_order": sum(not r["in_order"] for r in rows),
        "unclosed": sum(not r["closed"] for r in rows),
        "wrong_texts": sum(not r["text_ok"] for r in rows),
        "statuses": dict(Counter(r["status"] for r in rows)),
        "statuses_unlike_reference": sum(not r["status_ok"] for r in rows),
        "kill_to_first_new_s": {
            "min": min(firsts, default=None),
            "p50": percentile(firsts, 50),
            "max": max(firsts, default=None),
        },
        "rows": rows,
    }


def fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def table(report: dict) -> str:
    """The run's figures as a two-column table."""
    chat, bg = report["chat"], report["background"]
    first = bg["kill_to_first_new_s"]

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    rows = [
        ("chat streams in flight at the kill", f"{chat['in_flight_at_kill']}"),
        ("  of which failed (cannot be saved)", f"{chat['failed_in_flight_at_kill']}"),
        ("chat requests begun after the kill", f"{chat['begun_after_kill']}"),
        ("  succeeded (through router-1)", f"{chat['ok_after_kill']}"),
        ("  failed", f"{chat['failed_after_kill']}"),
        ("chat requests in all / wrong texts", f"{chat['requests']} / {chat['wrong_texts']}"),
        ("background responses / cut by the kill", f"{bg['responses']} / {bg['cut_by_kill']}"),
        (
            "  events lost / duplicated / out of order",
            f"{bg['lost_events']} / {bg['duplicated_events']} / {bg['out_of_order']}",
        ),
        ("  streams without a closing event", f"{bg['unclosed']}"),
        ("  wrong texts (vs uninterrupted run)", f"{bg['wrong_texts']}"),
        (
            "  final statuses / unlike the reference",
            f"{fmt_counts(bg['statuses'])} / {bg['statuses_unlike_reference']}",
        ),
        (
            "  kill -> first new event min / p50 / max",
            f"{secs(first['min'])} / {secs(first['p50'])} / {secs(first['max'])}",
        ),
        (f"router-1 {ADOPTIONS}", "-" if report["adoptions"] is None else f"{report['adoptions']:.0f}"),
        ("KV blocks held once idle", f"{report['held_blocks']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- the run ------------------------------------------------------------------------------------------


def cluster_config(folder: Path) -> Path:
    """1P1D of the built-in tiny model, two routers behind the front, all on free ports; the decode server's
    fault injection on; a failed process restarted only after the run."""
    pairs = free_port_pairs(2)
    ports = free_ports(3)
    config = {
        "fault_injection": True,
        "model": "tiny",
        "served_model_name": "tiny",
        "engine": {"num_threads": 1, "kv_cache_bytes": 16 << 20},
        "router": {
            "port": ports[0],
            "replicas": 2,
            "replica_ports": ports[1:],
            "health_interval_s": 0.25,
            "health_backoff_max_s": 0.5,
        },
        "lease_s": 10,
        "transfer": {"backend": "zmq"},
        "restart": {"backoff_s": NO_RESTART_S, "backoff_max_s": NO_RESTART_S},
        "prefill": [{"name": "p0", "port": pairs[0], "block_size": 4}],
        "decode": [{"name": "d0", "port": pairs[1], "block_size": 16, "kv_layout": "HND"}],
    }
    path = folder / "failover-1p1d.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def chat_body(prompt: str, tokens: int) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def background_body(i: int, tokens: int) -> dict:
    return {"model": "tiny", "input": background_question(i), "max_output_tokens": tokens, "temperature": 0}


def one_chat(http: httpx.Client, url: str, prompt: str, tokens: int, want: str) -> ChatOutcome:
    """One streamed chat completion through ``url``, judged against ``want``."""
    out = ChatOutcome("failed", time.monotonic(), 0.0)
    try:
        with http.stream(
            "POST", f"{url}/v1/chat/completions", json={**chat_body(prompt, tokens), "stream": True}
        ) as resp:
            if resp.status_code == 200:
                text, done = "", False
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                        break
                    for event in sse_events([line]):
                        if "error" in event:
                            raise ValueError(event["error"])
                        text += "".join(c["delta"].get("content") or "" for c in event.get("choices") or [])
                if done:
                    out.kind = "ok" if text == want else "wrong"
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    out.ended = time.monotonic()
    return out


class ChatLoad:
    """``clients`` threads, each sending streamed chat completions through the front until stopped."""

    def __init__(self, url: str, references: dict[str, str], clients: int, tokens: int, deadline_s: float) -> None:
        self.url, self.references, self.tokens, self.deadline_s = url, references, tokens, deadline_s
        self.outcomes: list[ChatOutcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 30)

    def _run(self, index: int) -> None:
        n = 0
        with httpx.Client(timeout=self.deadline_s) as http:
            while not self._stop.is_set():
                prompt = CHAT_PROMPTS[(index + n) % len(CHAT_PROMPTS)]
                n += 1
                outcome = one_chat(http, self.url, prompt, self.tokens, self.references[prompt])
                with self._lock:
                    self.outcomes.append(outcome)


def read_background(
    outcome: BackgroundOutcome, dying: str, other: str, killed: threading.Event, deadline_s: float
) -> None:
    """Reads the response's stream from router ``dying`` until the kill cuts it, then, once told of the
    kill, resumes it on router ``other`` after the last event read."""
    path = f"/v1/responses/{outcome.response_id}"
    try:
        with httpx.Client(timeout=deadline_s) as http:
            try:
                with http.stream("GET", dying + path, params={"stream": "true"}) as resp:
                    resp.raise_for_status()
                    for event in sse_events(resp.iter_lines()):
                        outcome.before.append(event)
                        if event.get("type") in TERMINAL:
                            return
            except httpx.HTTPError:
                pass  # router-0 killed under the stream
            if not killed.wait(deadline_s):
                raise TimeoutError("the stream from router-0 ended without a kill")
            params = {"stream": "true"}
            if outcome.before:
                params["starting_after"] = str(outcome.before[-1]["sequence_number"])
            with http.stream("GET", other + path, params=params) as resp:
                resp.raise_for_status()
                for event in sse_events(resp.iter_lines()):
                    outcome.after.append((time.monotonic(), event))
                    if event.get("type") in TERMINAL:
                        return
    except Exception as exc:  # reported per response, not lost in a thread
        outcome.error = repr(exc)


def deltas_read(outcome: BackgroundOutcome) -> int:
    return sum(e.get("type") == "response.output_text.delta" for e in outcome.before)


def logged_events(store: Path, response_id: str) -> int:
    """How many events the shared store holds for the response (router/api/response_store/sqlite.py)."""
    with sqlite3.connect(store) as db:
        return db.execute("SELECT COUNT(*) FROM response_events WHERE response_id = ?", (response_id,)).fetchone()[0]


def references(front: str, background: int, chat_tokens: int, tokens: int) -> tuple[dict[str, str], list[Reference]]:
    """Each prompt answered once through the front before any fault: chat texts, background texts."""
    with httpx.Client(timeout=120) as http:
        chat = {}
        for prompt in CHAT_PROMPTS:
            resp = http.post(f"{front}/v1/chat/completions", json=chat_body(prompt, chat_tokens))
            resp.raise_for_status()
            chat[prompt] = resp.json()["choices"][0]["message"]["content"]
        texts = []
        for i in range(background):
            resp = http.post(f"{front}/v1/responses", json={**background_body(i, tokens), "store": False})
            resp.raise_for_status()
            texts.append(Reference(output_text(resp.json()), resp.json()["status"]))
    return chat, texts


def routers_ready(cluster: RunningCluster) -> bool:
    """Every router sees every worker healthy."""
    try:
        for proc in cluster.processes("router"):
            health = httpx.get(proc["url"] + "/health", timeout=5).json()
            if not all(w["healthy"] for w in health["workers"]):
                return False
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return True


def run(args: argparse.Namespace) -> dict:
    folder = Path(args.run_dir or tempfile.mkdtemp(prefix="pdserve-failover-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cluster = launch(cluster_config(folder), folder / "run", cpu_list(args.cpus))
    try:
        return measure(cluster, args) | {"run_dir": str(folder)}
    finally:
        left = cluster.stop()
        if left:
            print(f"killed pids left after the launcher stopped: {left}", file=sys.stderr)


def measure(cluster: RunningCluster, args: argparse.Namespace) -> dict:
    front = cluster.url
    routers = {p["name"]: p for p in cluster.processes("router")}
    dying, other = routers["router-0"], routers["router-1"]
    wait_for(lambda: routers_ready(cluster), 60, "both routers see every worker healthy")
    chat_refs, bg_refs = references(front, args.background, args.chat_tokens, args.tokens)
    secret = cluster.run_dir / "internal_secret"
    admin = {"authorization": f"Bearer {secret.read_text().strip()}"} if secret.is_file() else {}
    for proc in cluster.processes("decode"):  # slow decode steps: generations long enough to be cut
        body = {"step_delay_s": args.step_delay_s}
        httpx.post(f"{proc['url']}/admin/faults", json=body, headers=admin, timeout=10).raise_for_status()

    load = ChatLoad(front, chat_refs, args.clients, args.chat_tokens, args.deadline_s)
    load.start()
    killed = threading.Event()
    outcomes: list[BackgroundOutcome] = []
    with httpx.Client(timeout=60) as http:
        for i in range(args.background):
            resp = http.post(
                f"{dying['url']}/v1/responses", json={**background_body(i, args.tokens), "background": True}
            )
            resp.raise_for_status()
            outcomes.append(BackgroundOutcome(resp.json()["id"]))
    readers = [
        threading.Thread(target=read_background, args=(o, dying["url"], other["url"], killed, args.deadline_s))
        for o in outcomes
    ]
    for t in readers:
        t.start()
    try:
        wait_for(
            lambda: all(deltas_read(o) >= args.kill_after_deltas or o.error for o in outcomes),
            args.deadline_s,
            f"every background stream read {args.kill_after_deltas} deltas from router-0",
        )
        killed_at = time.monotonic()
        os.kill(dying["pid"], signal.SIGKILL)
        store = cluster.run_dir / "responses.sqlite"
        for o in outcomes:  # router-0 is dead: what it logged is final
            o.logged_at_kill = logged_events(store, o.response_id)
    finally:
        killed.set()
    for t in readers:
        t.join(args.deadline_s + 30)
    load.stop()
    with httpx.Client(timeout=30) as http:
        for o in outcomes:
            o.status = http.get(f"{other['url']}/v1/responses/{o.response_id}").json().get("status", "")
        adoptions = metric_value(http.get(f"{other['url']}/metrics").text, ADOPTIONS)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "run_dir")},
        "chat": summarize_chat(load.outcomes, killed_at),
        "background": summarize_background(outcomes, bg_refs, killed_at),
        "adoptions": adoptions,
        "held_blocks": held_blocks(cluster, 30),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="threads sending streamed chat through the front")
    parser.add_argument("--background", type=int, default=8, help="background responses made on router-0")
    parser.add_argument("--chat-tokens", type=int, default=24, help="tokens of each chat completion")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens of each background response")
    parser.add_argument("--step-delay-s", type=float, default=0.04, help="the decode server's wait after each step")
    parser.add_argument("--kill-after-deltas", type=int, default=6, help="deltas each background stream reads first")
    parser.add_argument("--deadline-s", type=float, default=90.0, help="the longest wait for any one request")
    parser.add_argument("--cpus", help="cores for the cluster, e.g. 0-3 (default: all)")
    parser.add_argument("--run-dir", help="where the config and logs go (default: a new temporary folder)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    bg = report["background"]
    whole = bg["lost_events"] == bg["duplicated_events"] == bg["wrong_texts"] == bg["unclosed"] == 0
    whole = whole and bg["statuses_unlike_reference"] == bg["out_of_order"] == 0
    return 0 if whole and report["held_blocks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
