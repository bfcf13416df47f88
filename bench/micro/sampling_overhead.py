"""What sampling options cost in decode throughput, measured side by side in one run.

    python -m bench.micro.sampling_overhead [--model DIR] [--batch 8] [--tokens 64] [--json FILE]

Every variant decodes the same prompts with the engine (greedy, ignore_eos);
each repeat runs all variants one after another (a different one first each
time), so they share the machine's noise, and the median of --repeats is kept. Decode tokens/s is the time of
generating --tokens minus that of generating one (the prefill), per token.
Ratios are against the first variant (``plain``): 1.0 means no overhead.

Builds the tiny test model when no --model is given (sampling's share of a
step is then at its largest); --bench-model builds the ~90M model of
bench/micro/engine_bench.py instead. Variants are entries of ``VARIANTS``: a name
and the SamplingParams fields it sets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import TinySpec, make_tiny

VARIANTS: dict[str, dict] = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "logit_bias": {"logit_bias": ((11, 2.0), (40, -1.0), (97, 0.5))},
    "penalties+logprobs=5": {
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "logprobs": 5,
    },
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
}


def _prompt(n: int, salt: int) -> list[int]:
    return [(31 * i + 7 * salt) % 500 + 3 for i in range(n)]


def _seconds(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, fields: dict) -> float:
    sampling = SamplingParams(**{"temperature": 0, **fields, "max_tokens": max_tokens, "ignore_eos": True})
    start = time.perf_counter()
    engine.generate(prompts, sampling)
    return time.perf_counter() - start


def measure(
    engine: LLMEngine, variants: dict[str, dict], batch: int, tokens: int, prompt_len: int, repeats: int
) -> list[dict]:
    """Decode tokens/s per variant and its ratio to the first variant's."""
    prompts = [_prompt(prompt_len, s) for s in range(batch)]
    full: dict[str, list[float]] = {name: [] for name in variants}
    one: dict[str, list[float]] = {name: [] for name in variants}
    for fields in variants.values():  # warm-up
        _seconds(engine, prompts, 2, fields)
    names = list(variants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each variant leads in turn
            full[name].append(_seconds(engine, prompts, tokens, variants[name]))
            one[name].append(_seconds(engine, prompts, 1, variants[name]))
    decoded = batch * (tokens - 1)
    rows = []
    for name in variants:
        seconds = max(statistics.median(full[name]) - statistics.median(one[name]), 1e-9)
        rows.append({"variant": name, "decode_tok_s": decoded / seconds})
    base = rows[0]["decode_tok_s"]
    for row in rows:
        row["ratio"] = row["decode_tok_s"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m bench.micro.sampling_overhead"
    )
    parser.add_argument("--model", help="model directory (default: build the tiny test model)")
    parser.add_argument(
        "--bench-model", action="store_true", help="build the ~90M model of bench/micro/engine_bench.py"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="the median of this many runs is kept")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), help="default: all (plain first)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (decode throughput needs a token past the first)")
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from bench.micro.engine_bench import BENCH_SPEC

        spec = BENCH_SPEC if args.bench_model else TinySpec()
        model = str(make_tiny(tempfile.mkdtemp(prefix="sampling-overhead-"), spec))
    names = ["plain", *[n for n in (args.variants or VARIANTS) if n != "plain"]]
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            num_blocks=1024,
            block_size=16,
            max_num_seqs=max(64, args.batch),
            num_threads=args.threads,
        )
    )
    rows = measure(engine, {n: VARIANTS[n] for n in names}, args.batch, args.tokens, args.prompt_len, args.repeats)
    print(f"model {model}, batch {args.batch}, {args.tokens} tokens, median of {args.repeats}")
    print(f"{'variant':<24}{'decode tok/s':>14}{'ratio':>8}")
    for row in rows:
        print(f"{row['variant']:<24}{row['decode_tok_s']:>14.1f}{row['ratio']:>8.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
