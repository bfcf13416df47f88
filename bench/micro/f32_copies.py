"""A float32 engine holding its projections once against one holding them twice: speed and resident memory.

    python -m bench.micro.f32_copies [--model smollm2] [--threads 1] [--prompt-len 512] \\
        [--batch 1,4,16] [--steps 32] [--rounds 3] [--json FILE]

Two worker processes load the same model in float32, one as served by default (each projection's one
input-major tensor: engine/model.py ``Linear``), one with ``PDSERVE_F32_PACKED_COPY=1`` (a oneDNN-packed
copy beside it, as before). Each reports its VmRSS once loaded and warmed up, then in turn, the order
reversed each round: the prefill of one ``--prompt-len``-token prompt (tokens per second) and
``--steps`` decode-only steps of each ``--batch`` size (tokens per second over the batch). Times are
the worker's CPU time (``time.process_time``: time spent descheduled on a shared machine is not
counted; with ``--threads 1`` this is the engine's thread) and wall time, medians over ``--rounds``.
ratio = one copy's tok/s / two copies': below 1, one copy is slower by that much.
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
SIDES = {"one_copy": "1", "two_copies": "2"}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _worker(model: str, threads: int) -> None:
    results = os.fdopen(os.dup(1), "w")  # the driver reads only these lines: anything printed goes to stderr
    os.dup2(2, 1)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.models import MODEL_CACHE, resolve_model

    engine = LLMEngine(
        EngineConfig(
            model=str(resolve_model(model, MODEL_CACHE)),
            dtype="float32",
            num_threads=threads,
            num_blocks=1024,
            block_size=16,
            max_num_seqs=64,
            prefix_caching=False,
        )
    )
    salt = 0

    def prompt(length: int) -> list[int]:
        nonlocal salt
        salt += 1
        return [(31 * j + 7 * salt) % 500 + 3 for j in range(length)]

    def timed(run) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        return time.perf_counter() - wall, time.process_time() - cpu

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()

    print(json.dumps({"rss_mib": _rss_mib()}), file=results, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["kind"] == "prefill":
            n = int(cmd["tokens"])
            tokens = prompt(n)
            engine.add_request(f"p{salt}", tokens, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            wall, cpu = timed(drain)
            count = n
        else:
            batch, steps = int(cmd["batch"]), int(cmd["steps"])
            params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
            waiting = set()
            for _ in range(batch):
                tokens = prompt(16)
                engine.add_request(f"r{salt}", tokens, params)
                waiting.add(f"r{salt}")
            while waiting:
                waiting -= {out.request_id for out in engine.step() if out.new_token_ids}
            engine.step()  # the first decode step is not timed

            def decode(steps: int = steps) -> None:
                for _ in range(steps):
                    engine.step()

            wall, cpu = timed(decode)
            drain()
            count = batch * steps
        print(json.dumps({"wall_tok_s": count / wall, "cpu_tok_s": count / cpu, "rss_mib": _rss_mib()}),
              file=results, flush=True)  # fmt: skip


class Side(WorkerSide):
    def __init__(self, name: str, args) -> None:
        env = {**os.environ, "PDSERVE_F32_WEIGHT_COPIES": SIDES[name]}
        cmd = [sys.executable, str(HERE), "--worker", "--model", args.model, "--threads", str(args.threads)]
        super().__init__(name, cmd, cwd=REPO, env=env)
        self.loaded_rss = self.read()["rss_mib"]

    def run(self, cmd: dict) -> dict:
        return self.ask(cmd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.micro.f32_copies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="model folder or built-in name (default smollm2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", default="1,4,16", help="decode batch sizes (default 1,4,16)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.threads)
        return 0
    cmds = [{"kind": "prefill", "tokens": args.prompt_len, "label": f"prefill {args.prompt_len}"}]
    cmds += [
        {"kind": "decode", "batch": int(b), "steps": args.steps, "label": f"decode x{b}"} for b in args.batch.split(",")
    ]
    sides = [Side(name, args) for name in SIDES]
    report: dict = {"model": args.model, "threads": args.threads, "rss_loaded_mib": {}, "rows": []}
    try:
        for side in sides:
            side.run(cmds[0])  # warm-up: the first prefill compiles oneDNN's kernels
            report["rss_loaded_mib"][side.name] = side.loaded_rss
        samples: dict[tuple[str, str], list[dict]] = {}
        for r in range(args.rounds):
            for cmd in cmds:
                for side in sides if r % 2 == 0 else sides[::-1]:
                    got = side.run(cmd)
                    samples.setdefault((cmd["label"], side.name), []).append(got)
                    print(f"round {r} {cmd['label']} {side.name}: {json.dumps(got)}", file=sys.stderr, flush=True)
        for side in sides:
            after = side.run({"kind": "decode", "batch": 1, "steps": 1})
            report["rss_loaded_mib"][side.name + "_after"] = after["rss_mib"]
        for cmd in cmds:
            row: dict = {"what": cmd["label"]}
            for side in sides:
                got = samples[(cmd["label"], side.name)]
                for clock in ("cpu", "wall"):
                    row[f"{side.name}_{clock}_tok_s"] = round(statistics.median(s[f"{clock}_tok_s"] for s in got), 1)
            for clock in ("cpu", "wall"):
                row[f"ratio_{clock}"] = round(row[f"one_copy_{clock}_tok_s"] / row[f"two_copies_{clock}_tok_s"], 3)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        for side in sides:
            side.close()
    print(json.dumps({"rss_mib": report["rss_loaded_mib"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
