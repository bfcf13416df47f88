"""How much two engines on one machine slow each other: the cross-instance
interference an xPyD layout on shared cores pays and a profile taken alone
does not see.

    python -m bench.compare.interference [--model DIR] [--seconds 20] [--cpus 0,1] [--json OUT]

Each case runs one or two engine processes, each pinned to its own core with
one torch thread (as ``bench compare`` runs 1P1D on two cores), for the same
``--seconds`` after both have loaded the model and warmed up:

    decode alone           8 streams decoding (prompts of 64-256 tokens, 200-400 tokens out)
    decode + prefill       the same, while the other core prefills 2048-token prompts back to back
                           (``--prefill-tokens``)
    decode + decode        the same, while the other core decodes 8 streams too
    prefill alone          2048-token prompts back to back
    prefill + decode       the same, while the other core decodes 8 streams

It reports the median and mean time of a pure decode step (no prompt chunk
in it) and of a prefill, and each one's slowdown next to the
other workload, measured side by side in one run. Engine steps only: no
HTTP, router or KV transfer, so what it finds is the machine's share
(caches, memory bandwidth), not the serving stack's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODE_STREAMS = 8
CASES = (
    ("decode alone", ("decode",)),
    ("decode + prefill", ("decode", "prefill")),
    ("decode + decode", ("decode", "decode")),
    ("prefill alone", ("prefill",)),
    ("prefill + decode", ("prefill", "decode")),
)


def child(role: str, model: str, seconds: float, prefill_tokens: int) -> None:
    """One engine, one torch thread: warms up, says ``ready``, waits for ``go`` on
    stdin, runs ``role`` for ``seconds`` and prints its step times as JSON."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from bench.plan.profile import timed_step
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            device="cpu",
            num_blocks=2048,
            max_num_batched_tokens=max(prefill_tokens, 2048),
        )
    )
    rng = np.random.default_rng(0)  # the same streams in every case
    ids = iter(range(10**9))
    vocab = engine.hf_config.vocab_size

    def add(length: int, max_tokens: int) -> None:
        prompt = [int(t) for t in rng.integers(3, vocab - 1, size=length)]
        engine.add_request(
            f"i{next(ids)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )

    add(64, 2)
    while engine.has_unfinished():
        timed_step(engine)
    print("ready", flush=True)
    sys.stdin.readline()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if role == "prefill":
            add(prefill_tokens, 1)
            sample = timed_step(engine)  # the whole prompt in one step: the budget is its length
            times.append(sample.seconds)
            while engine.has_unfinished():
                timed_step(engine)
            continue
        # Long answers of different lengths: refills are rare, and one short prompt each.
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < DECODE_STREAMS:
            add(int(rng.integers(64, 257)), int(rng.integers(200, 401)))
        sample = timed_step(engine)
        if sample is not None and sample.attn_pairs == 0:  # a pure decode step
            times.append(sample.seconds)
    print(json.dumps(times), flush=True)


def run_case(roles: tuple[str, ...], cores: list[int], model: str, seconds: float, prefill_tokens: int) -> list[float]:
    """The first role's step times, measured while the others run on the next cores."""
    procs = []
    try:
        for role, core in zip(roles, cores):
            cmd = [
                sys.executable,
                "-m",
                "bench.compare.interference",
                "--child",
                role,
                "--model",
                model,
                "--seconds",
                str(seconds),
                "--prefill-tokens",
                str(prefill_tokens),
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    preexec_fn=lambda c=core: os.sched_setaffinity(0, {c}),
                )
            )
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"an engine process failed to start (exit {p.wait()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.wait(timeout=60)
        return results[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def summarize(times: list[float]) -> dict:
    return {"steps": len(times), "median_ms": 1000 * statistics.median(times), "mean_ms": 1000 * statistics.mean(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare.interference",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[2:]),
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="model folder (default: bench compare's ~90M benchmark model, built under runs/models if absent)",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="measured time per case (default %(default)s)")
    p.add_argument("--cpus", metavar="A,B", default=None, help="two cores (default: the first two allowed)")
    p.add_argument(
        "--prefill-tokens", type=int, default=2048, help="prompt length of the prefill workload (default %(default)s)"
    )
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--child", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.prefill_tokens < 1:
        p.error("--seconds and --prefill-tokens must be positive")
    if args.child:
        child(args.child, args.model, args.seconds, args.prefill_tokens)
        return 0
    from bench.load.cluster import cpu_list

    try:
        cores = cpu_list(args.cpus)
    except ValueError as exc:
        p.error(str(exc))
    if len(cores) < 2:
        p.error(f"needs two cores, {cores} allowed")
    cores = cores[:2][::-1]  # the measured engine on the second core, the other one on the first
    if args.model:
        model = args.model
    else:
        from bench.compare.compare import benchmark_model

        model = benchmark_model(Path("runs") / "models")
    results = {}
    for i, (name, roles) in enumerate(CASES, 1):
        print(
            f"[{i}/{len(CASES)}] {name}: {args.seconds:g} s on cores {cores[: len(roles)]} ...",
            file=sys.stderr,
            flush=True,
        )
        results[name] = summarize(run_case(roles, cores, model, args.seconds, args.prefill_tokens))
    slowdown = {
        "decode next to prefill": results["decode + prefill"]["mean_ms"] / results["decode alone"]["mean_ms"],
        "decode next to decode": results["decode + decode"]["mean_ms"] / results["decode alone"]["mean_ms"],
        "prefill next to decode": results["prefill + decode"]["mean_ms"] / results["prefill alone"]["mean_ms"],
    }
    print("| case | steps | median ms | mean ms |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['steps']} | {r['median_ms']:.1f} | {r['mean_ms']:.1f} |")
    print("\n| slowdown (mean step time, side by side) | ratio |\n|---|---|")
    for name, ratio in slowdown.items():
        print(f"| {name} | {ratio:.2f}x |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": model,
                    "cores": cores,
                    "seconds": args.seconds,
                    "prefill_tokens": args.prefill_tokens,
                    "cases": results,
                    "slowdown": slowdown,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
