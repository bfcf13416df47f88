"""``python -m bench.micro.noisy_neighbour``: the engine's decode beside one busy process, with its thread
team governed (engine/contention.py) and not.

One engine (``--model``, float32, ``--threads`` torch threads: all the cores by default) decodes
``--streams`` sequences at once (prompts of 64 tokens, ``--tokens`` out, greedy), in phases one after
the other, each on the same engine:

1. **quiet**: nothing else runs;
2. **neighbour, fixed team**: one single-threaded busy loop (a process at normal priority, as a
   sidecar or a second tenant would be) beside it, the governor off: every step on the full team;
3. **neighbour, governed**: the same loop, the governor on: it takes a thread off while the engine
   waits for cores;
4. **quiet again, governed**: the loop stopped: the governor gives the thread back (how long it took).

Per phase: the median and p90 of a decode step's time (the inter-token latency of each stream), the
team's size at the end, and the ratios to quiet. The busy loop is started and stopped by its pid.

``--served``: the same through the whole server, as a client sees it: configs/colocated.yaml
launched twice (``engine.adapt_threads`` off, then on; ``--threads`` torch threads), and on each
``pdserve bench serve`` (completions, prompts of 128 tokens, 64 out) at each stream count, quiet and
beside the busy loop; per row the ITL and TPOT p50 and output tokens/s, and the ratios to quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.contention import ThreadGovernor
from engine.models import MODEL_CACHE, resolve_model

REPO = Path(__file__).resolve().parents[2]


def decode_steps(
    engine: LLMEngine, streams: int, tokens: int, tag: str, on_step: Callable[[], None] | None = None
) -> list[float]:
    """Each decode-only step's seconds while ``streams`` sequences generate ``tokens`` tokens."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"{tag}-{i}", [(7 * i + 13 * k) % 500 + 3 for k in range(64)], sampling)
    times = []
    while engine.has_unfinished():
        prefill = any(r.num_computed < r.num_tokens - 1 for r in (*engine.scheduler.running, *engine.scheduler.waiting))
        t0 = time.perf_counter()
        engine.step()
        if not prefill:
            times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step()
    return times


def busy_loop() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def summary(times: list[float], engine: LLMEngine) -> dict:
    ordered = sorted(times)
    return {
        "steps": len(times),
        "p50_ms": round(1000 * statistics.median(ordered), 2),
        "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 2),
        "threads_at_end": torch.get_num_threads(),
        "drops": engine.governor.drops if engine.governor else 0,
    }


def serve_once(url: str, model: str, streams: int, out: Path) -> dict:
    """One ``pdserve bench serve`` run: ``streams`` at a time, 4 requests each; its summary's figures."""
    cmd = [sys.executable, "-m", "deploy.cli", "bench", "serve", "--url", url, "--model", model]
    cmd += ["--concurrency", str(streams), "--num-requests", str(4 * streams), "--prompt-len", "128"]
    cmd += ["--output-len", "64", "--json", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(REPO)))
    summary = json.loads(out.read_text())["summary"]
    return {
        "itl_p50_ms": round(summary["itl"]["p50"], 1),
        "tpot_p50_ms": round(summary["tpot"]["p50"], 1),
        "output_tok_s": round(summary["output_token_throughput"], 1),
        "failed": summary["failed"],
    }


def served(args: argparse.Namespace) -> list[dict]:
    """Rows of ``--served`` (module docstring)."""
    import yaml

    from bench.load.cluster import free_port_pairs, launch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for adapt in (False, True):
            data = yaml.safe_load((REPO / "configs" / "colocated.yaml").read_text())
            data["model"] = args.model
            data["engine"] = {**data["engine"], "num_threads": args.threads, "adapt_threads": adapt}
            router_port, server_port = free_port_pairs(2)
            data["router"]["port"] = router_port
            data["colocated"][0].update(port=server_port, kv_port=server_port + 1)
            path = Path(tmp) / f"colocated-{adapt}.yaml"
            path.write_text(yaml.safe_dump(data))
            cluster = launch(path, Path(tmp) / f"run-{adapt}", sorted(os.sched_getaffinity(0)))
            try:
                serve_once(cluster.url, cluster.model, 1, Path(tmp) / "warmup.json")
                for streams in [int(s) for s in args.streams.split(",")]:
                    row: dict = {"adapt_threads": adapt, "streams": streams}
                    row["quiet"] = serve_once(cluster.url, cluster.model, streams, Path(tmp) / "q.json")
                    loop = busy_loop()
                    try:
                        row["neighbour"] = serve_once(cluster.url, cluster.model, streams, Path(tmp) / "n.json")
                    finally:
                        loop.kill()
                        loop.wait()
                    row["itl_over_quiet"] = round(row["neighbour"]["itl_p50_ms"] / row["quiet"]["itl_p50_ms"], 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                cluster.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro.noisy_neighbour", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a built-in model or a folder (default %(default)s)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    p.add_argument("--streams", default="1,8", help="comma-separated stream counts, one row each")
    p.add_argument("--tokens", type=int, default=96, help="tokens each stream decodes per phase")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--served", action="store_true", help="through a launched colocated server (docstring)")
    args = p.parse_args(argv)
    if args.served:
        rows = served(args)
        if args.json is not None:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    model = str(resolve_model(args.model, MODEL_CACHE))
    engine = LLMEngine(EngineConfig(model=model, num_threads=args.threads, adapt_threads=True, max_num_seqs=16))
    governor = engine.governor
    assert governor is not None, "no governor: one thread, or /proc/self/task/*/schedstat unreadable"
    decode_steps(engine, 2, 16, "warmup")
    rows = []
    for streams in [int(s) for s in args.streams.split(",")]:
        row: dict = {"streams": streams}
        engine.governor = None
        row["quiet"] = summary(decode_steps(engine, streams, args.tokens, "quiet"), engine)
        loop = busy_loop()
        try:
            torch.set_num_threads(args.threads)
            row["neighbour_fixed"] = summary(decode_steps(engine, streams, args.tokens, "fixed"), engine)
            engine.governor = ThreadGovernor(args.threads, torch.set_num_threads)
            row["neighbour_governed"] = summary(decode_steps(engine, streams, args.tokens, "governed"), engine)
        finally:
            loop.kill()
            loop.wait()
        gone, back = time.monotonic(), []

        def full_team_again(back: list[float] = back, gone: float = gone) -> None:
            if not back and torch.get_num_threads() == args.threads:
                back.append(round(time.monotonic() - gone, 2))

        row["quiet_again_governed"] = summary(
            decode_steps(engine, streams, args.tokens, "again", full_team_again), engine
        )
        row["threads_back_after_s"] = back[0] if back else None
        quiet = row["quiet"]["p50_ms"]
        row["fixed_over_quiet"] = round(row["neighbour_fixed"]["p50_ms"] / quiet, 2)
        row["governed_over_quiet"] = round(row["neighbour_governed"]["p50_ms"] / quiet, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        engine.governor = None
        torch.set_num_threads(args.threads)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
