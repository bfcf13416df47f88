"""What one decode step of the engine costs, and the same step of another checkout beside it.

    python -m bench.micro.decode_step [--model smollm2] [--dtype float32] [--batch 1,8] [--threads 2] \\
        [--steps 64] [--prompt-len 16] [--rounds 5] [--against DIR] [--json FILE]

Each side is a worker process holding one engine (``--threads`` torch
threads, pinned to the same cores): it admits ``batch`` requests of ``--prompt-len``-token
prompts (16 by default), prefills them, then times ``--steps`` decode-only steps and reports
milliseconds per step. With ``--against DIR`` a second worker imports the
engine from DIR (another checkout of this repository, e.g. ``git archive``
of an earlier commit) and the two take turns, the order reversed each round,
so a change is measured as one ratio from one run on the same machine
(ratio = DIR's ms / this checkout's ms: above 1, this checkout is faster).

``--lm-head`` times the model's lm_head alone instead (its shape from the
model's config, float32, random weights, ``--threads`` threads, in this process):
for each batch size, the path a tied lm_head took before engine.native's
``logits_f32`` (one row: ``F.linear`` over the input-major copy; more:
oneDNN's packed copy) beside the path it takes now where ``gemv_f32`` is not
built (one row as before; two to eight: ``logits_f32`` over the embedding's
rows, engine/model.py ``Linear.read_rows``), ``logits_f32`` alone, and torch's own ways over the rows
(``F.linear``; oneDNN reading it in place); with a sum over the weight as the
memory-speed bound (GB/s = the weight's bytes / time). Rounds alternate the
order; each line gives wall-clock median and best, this process's CPU time
(less swayed by other work on the cores) and the load average.

``--profile-dir DIR`` runs a single side under ``py-spy record`` (``pip
install py-spy``) and writes one speedscope/flame file per batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.micro.worker_side import WorkerSide

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


# ---- worker (runs with either checkout's engine on sys.path) ---------------------------------


def _worker(model: str, dtype: str, threads: int) -> None:
    results = os.fdopen(os.dup(1), "w")  # the driver reads only these lines: anything printed goes to stderr
    os.dup2(2, 1)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.models import MODEL_CACHE, resolve_model

    engine = LLMEngine(
        EngineConfig(
            model=str(resolve_model(model, MODEL_CACHE)),
            dtype=dtype,
            num_threads=threads,
            num_blocks=1024,
            block_size=16,
            max_num_seqs=64,
        )
    )
    salt = 0
    for line in sys.stdin:
        cmd = json.loads(line)
        batch, steps, prompt_len = int(cmd["batch"]), int(cmd["steps"]), int(cmd["prompt_len"])
        params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
        waiting = set()
        for _ in range(batch):
            salt += 1
            engine.add_request(f"r{salt}", [(31 * j + 7 * salt) % 500 + 3 for j in range(prompt_len)], params)
            waiting.add(f"r{salt}")
        while waiting:  # the prefill (one chunk for every prompt, or more for long ones)
            waiting -= {out.request_id for out in engine.step() if out.new_token_ids}
        engine.step()  # the first decode step is not timed (lazy allocations)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ms = (time.perf_counter() - start) * 1000 / steps
        while engine.has_unfinished():
            engine.step()
        print(json.dumps({"ms_per_step": ms}), file=results, flush=True)


# ---- the lm_head alone ----------------------------------------------------------------------------


def _lm_head(args, batches: list[int]) -> int:
    import torch
    import torch.nn.functional as F

    from engine import native
    from engine.loader import load_config
    from engine.models import MODEL_CACHE, resolve_model
    from engine.row_buckets import packed_linear

    torch.set_num_threads(args.threads)
    cfg = load_config(str(resolve_model(args.model, MODEL_CACHE)))
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    kernel = native.kernel("logits_f32")
    print(native.logits_status(), flush=True)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.02  # [vocab, hidden]: the embedding's rows
    input_major = weight.t().contiguous().t()  # the float32 Linear's weight before (Linear.pack_for_cpu)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    xs = {b: torch.randn(b, hidden, generator=gen) for b in batches}
    ways: dict[str, Callable] = {
        "old (input-major / packed)": lambda x: (
            F.linear(x, input_major) if x.shape[0] == 1 else packed_linear(x, packed, None)
        ),
        "F.linear over the rows": lambda x: F.linear(x, weight),
        "oneDNN over the rows": lambda x: packed_linear(x, weight, None),
    }
    if kernel is not None:  # the tied lm_head's path now (Linear.read_rows) where gemv_f32 is not built
        ways["new (input-major / logits_f32)"] = lambda x: (
            F.linear(x, input_major) if x.shape[0] == 1 else kernel(x, weight)
        )
        ways["logits_f32 over the rows"] = lambda x: kernel(x, weight)
    for b in batches:  # every way gives the same logits (float32 sums in other orders)
        want = xs[b].double() @ weight.double().t()
        for name, way in ways.items():
            err = (way(xs[b]).double() - want).abs().max().item()
            assert err < 1e-4, (name, b, err)
    cases = [("sum (memory bound)", 1, lambda x: weight.sum())] + [(n, b, w) for b in batches for n, w in ways.items()]
    wall: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    loads = []
    for r in range(args.rounds):
        loads.append(Path("/proc/loadavg").read_text().split()[0])
        for name, b, way in cases if r % 2 == 0 else reversed(cases):
            way(xs[b])
            for _ in range(3):
                w0, c0 = time.perf_counter(), time.process_time()
                way(xs[b])
                wall.setdefault((name, b), []).append(time.perf_counter() - w0)
                cpu.setdefault((name, b), []).append(time.process_time() - c0)
    mb = weight.nbytes / 1e6
    print(f"lm_head [{vocab} x {hidden}] float32 ({mb:.0f} MB), {args.threads} threads, {args.rounds} rounds x 3;"
          f" load average at each round: {' '.join(loads)}")  # fmt: skip
    print(
        f"{'':32} {'batch':>5} {'wall med':>9} {'best':>7} {'cpu med':>8} {'GB/s':>6}   old / this (wall med, cpu med)"
    )
    for (name, b), ws in wall.items():
        cs, key = cpu[(name, b)], ("old (input-major / packed)", b)
        ratio = ""
        if key in wall and not name.startswith("sum"):
            by_wall = statistics.median(wall[key]) / statistics.median(ws)
            ratio = f"   {by_wall:.2f}x {statistics.median(cpu[key]) / statistics.median(cs):.2f}x"
        print(
            f"{name:32} {b:>5} {statistics.median(ws) * 1e3:8.1f}ms {min(ws) * 1e3:6.1f}ms"
            f" {statistics.median(cs) * 1e3:7.1f}ms {mb / 1e3 / min(ws):6.1f}{ratio}"
        )
    return 0


# ---- driver --------------------------------------------------------------------------------------


class Side(WorkerSide):
    def __init__(self, name: str, root: Path, args, cores: list[int], profile: Path | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, str(HERE), "--worker", "--model", args.model, "--dtype", args.dtype]
        cmd += ["--threads", str(args.threads)]
        if profile is not None:
            cmd = ["py-spy", "record", "--format", "speedscope", "-o", str(profile), "--", *cmd]
        super().__init__(name, cmd, cwd=root, env=env, preexec_fn=lambda: os.sched_setaffinity(0, cores))

    def run(self, batch: int, steps: int, prompt_len: int) -> float:
        return float(self.ask({"batch": batch, "steps": steps, "prompt_len": prompt_len})["ms_per_step"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro.decode_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder or built-in name (default smollm2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpus", default=None, help="cores for the workers, e.g. 0,1 (default: this process's)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per measurement")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=16,
        help="prompt tokens per sequence: the timed steps attend over prompt-len to prompt-len + steps (default 16)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--against", type=Path, default=None, help="another checkout to measure beside this one")
    p.add_argument("--lm-head", action="store_true", help="time the lm_head's ways alone (in this process)")
    p.add_argument("--profile-dir", type=Path, default=None, help="py-spy record this checkout's worker")
    p.add_argument("--json", default=None, help="write every sample here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.dtype, args.threads)
        return 0
    from bench.load.cluster import cpu_list

    cores = cpu_list(args.cpus)
    batches = [int(b) for b in args.batch.split(",")]
    if args.lm_head:
        return _lm_head(args, batches)
    if args.profile_dir is not None:
        if args.against is not None:
            p.error("--profile-dir profiles this checkout alone: drop --against")
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        for b in batches:
            side = Side("this", REPO, args, cores, args.profile_dir / f"decode-{args.dtype}-b{b}.speedscope.json")
            try:
                for _ in range(args.rounds):
                    print(f"batch {b}: {side.run(b, args.steps, args.prompt_len):.2f} ms/step", flush=True)
            finally:
                side.close()
        return 0
    sides = [Side("this", REPO, args, cores)]
    if args.against is not None:
        sides.append(Side("against", args.against.resolve(), args, cores))
    samples: dict[str, dict[int, list[float]]] = {s.name: {b: [] for b in batches} for s in sides}
    try:
        for s in sides:  # warm-up
            s.run(batches[0], 4, args.prompt_len)
        for r in range(args.rounds):
            for b in batches:
                for s in sides if r % 2 == 0 else reversed(sides):
                    samples[s.name][b].append(s.run(b, args.steps, args.prompt_len))
                    print(f"round {r + 1}, batch {b}, {s.name}: {samples[s.name][b][-1]:.2f} ms/step", flush=True)
    finally:
        for s in sides:
            s.close()
    print(f"decode step, {args.dtype}, {args.threads} threads, ms per step (median, range of {args.rounds})")
    for b in batches:
        line = f"batch {b:>3}:"
        for s in sides:
            v = samples[s.name][b]
            line += f"  {s.name} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
        if args.against is not None:
            line += f"  ratio {statistics.median(samples['against'][b]) / statistics.median(samples['this'][b]):.2f}x"
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args) | {"against": str(args.against), "profile_dir": None}, "samples": samples}, indent=2
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
