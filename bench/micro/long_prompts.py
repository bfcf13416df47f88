"""Concurrent long prompts in the engine alone: several 1024-token prompts arriving while others decode.

    python -m bench.micro.long_prompts [--model smollm2] [--streams 4] [--requests 16] [--prompt-len 1024] \\
        [--output-len 128] [--threads 1] [--rounds 3] [--against DIR] [--json FILE]

The engine-level form of issue 49's 4x16 1024/128 row, with no HTTP: a closed loop of ``--streams``
streams, each adding its next request (a new prompt, ``ignore_eos``) as soon as its last one
finished, until ``--requests`` are done; every step's plan is the scheduler's own. The loop adds
requests between steps, never on a clock, so the same checkout runs the same steps in every round,
and a round's cost is the worker's CPU time (with ``--threads 1``, what the machine's other work
takes from it is not counted; with more threads the figures are wall time). Reported per side:
output tokens and prompt tokens per second, the steps, and TTFT p50 on the same clock (from a
request's add to the step that drew its first token).

With ``--against DIR`` a second worker imports the engine from DIR (another checkout, e.g.
``git worktree add --detach DIR <commit>``) and the two take turns, the order reversed each round;
ratio = this checkout's output tok/s / DIR's (above 1, this checkout is faster), TTFT DIR's / this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.micro.worker_side import WorkerSide

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


def _worker(model: str, threads: int) -> None:
    results = os.fdopen(os.dup(1), "w")  # the driver reads only these lines: anything printed goes to stderr
    os.dup2(2, 1)
    from engine import EngineConfig, LLMEngine
    from engine.models import MODEL_CACHE, resolve_model

    engine = LLMEngine(
        EngineConfig(model=str(resolve_model(model, MODEL_CACHE)), num_threads=threads, kv_cache_bytes=256 << 20)
    )
    clock = time.process_time if threads == 1 else time.perf_counter
    salt = 0
    for line in sys.stdin:
        cmd = {key: int(value) for key, value in json.loads(line).items()}
        sample = _round(engine, clock, salt, cmd["streams"], cmd["requests"], cmd["prompt_len"], cmd["output_len"])
        salt += int(cmd["requests"])
        print(json.dumps(sample), file=results, flush=True)


def _round(engine, clock, salt: int, streams: int, total: int, prompt_len: int, output_len: int = 0) -> dict:
    """One closed loop; request i's prompt is made from ``salt + i``, new for every round."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    added_at: dict[str, float] = {}
    first_at: dict[str, float] = {}

    def add() -> None:
        n = salt + len(added_at) + 1
        prompt = [(31 * j + 7 * n + j * j * n) % 30000 + 3 for j in range(prompt_len)]
        engine.add_request(f"r{n}", prompt, params)
        added_at[f"r{n}"] = clock()

    start, steps, out_tokens = clock(), 0, 0
    for _ in range(min(streams, total)):
        add()
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        now = clock()
        for out in outputs:
            out_tokens += len(out.new_token_ids)
            if out.new_token_ids:
                first_at.setdefault(out.request_id, now)
            if out.finished and len(added_at) < total:
                add()
    seconds = clock() - start
    ttft = [first_at[r] - added_at[r] for r in added_at]
    return {
        "output_tok_s": out_tokens / seconds,
        "prompt_tok_s": total * prompt_len / seconds,
        "seconds": seconds,
        "steps": steps,
        "ttft_p50_ms": 1000 * statistics.median(ttft),
    }


class Side(WorkerSide):
    def __init__(self, name: str, root: Path, args, cores: list[int]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(HERE), "--worker", "--model", args.model, "--threads", str(args.threads)]
        super().__init__(name, cmd, cwd=root, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores))

    def run(self, streams: int, requests: int, prompt_len: int, output_len: int) -> dict:
        return self.ask({"streams": streams, "requests": requests, "prompt_len": prompt_len, "output_len": output_len})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro.long_prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder or built-in name (default smollm2)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpus", default=None, help="cores for the workers, e.g. 0,1 (default: this process's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", type=Path, default=None, help="another checkout to measure beside this one")
    p.add_argument("--json", default=None, help="write every sample here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.threads)
        return 0
    from bench.load.cluster import cpu_list

    cores = cpu_list(args.cpus)
    sides = [Side("this", REPO, args, cores)]
    if args.against is not None:
        sides.append(Side("against", args.against.resolve(), args, cores))
    samples: dict[str, list[dict]] = {s.name: [] for s in sides}
    loads = []
    try:
        for s in sides:  # warm-up: every shape of the workload once
            s.run(args.streams, args.streams, args.prompt_len, 4)
        for r in range(args.rounds):
            for s in sides if r % 2 == 0 else reversed(sides):
                loads.append(Path("/proc/loadavg").read_text().split()[0])
                samples[s.name].append(s.run(args.streams, args.requests, args.prompt_len, args.output_len))
                print(f"round {r + 1}, {s.name}: {json.dumps(samples[s.name][-1])}", flush=True)
    finally:
        for s in sides:
            s.close()
    clock = "CPU" if args.threads == 1 else "wall"
    print(
        f"{args.streams} streams x {args.requests} requests, {args.prompt_len}/{args.output_len}, {args.threads} "
        f"thread(s), {clock} time, median (range) of {args.rounds}; load average before each run {', '.join(loads)}"
    )
    med = {}
    for s in sides:
        v = samples[s.name]
        med[s.name] = {k: statistics.median(x[k] for x in v) for k in v[0]}
        line = f"{s.name:>8}:"
        for key in ("output_tok_s", "prompt_tok_s", "ttft_p50_ms", "steps"):
            values = [x[key] for x in v]
            line += f"  {key} {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
        print(line)
    if args.against is not None:
        print(
            f"   ratio:  output tok/s {med['this']['output_tok_s'] / med['against']['output_tok_s']:.3f}x"
            f"  TTFT p50 {med['against']['ttft_p50_ms'] / med['this']['ttft_p50_ms']:.3f}x"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args) | {"against": str(args.against)}, "loads": loads, "samples": samples}) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
