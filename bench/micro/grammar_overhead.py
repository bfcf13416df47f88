"""The per-token cost of grammar-constrained decoding, measured side by side in one run.

    python -m bench.micro.grammar_overhead [--model DIR] [--batch 1,8,32] [--tokens 64] [--threads 2] [--json FILE]

The same prompts are decoded greedily with no grammar and with a JSON schema
(engine/structured.py), alternately, --repeats times; the medians of the decode
steps' wall time per generated token are compared (the prefill step is left
out). The grammar work alone (mask every row, feed the chosen token, on random
logits, no model) is timed too: the overhead without the model's noise. A
grammar may end an answer early, so each side is measured per token it
produced. Builds the ~90M benchmark model of bench/micro/engine_bench.py (vocabulary
16,384) when no --model is given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time

import torch

from bench.micro.engine_bench import BENCH_SPEC, _prompt
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import make_tiny
from engine.request import StructuredSpec

# Open-ended enough that a random model keeps writing: a list of free strings and numbers.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "score": {"type": "number"}},
                "required": ["name", "score"],
            },
        }
    },
    "required": ["items"],
}


def decode_time(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams, ids) -> tuple[float, int]:
    """(seconds in decode steps, tokens they produced)."""
    for prompt in prompts:
        engine.add_request(f"g{next(ids)}", prompt, sampling)
    engine.step()  # every prompt fits one step: the prefill, not measured
    seconds, tokens = 0.0, 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        seconds += time.perf_counter() - start
        tokens += sum(len(o.new_token_ids) for o in outputs)
    return seconds, tokens


def measure(engine: LLMEngine, batch: int, max_tokens: int, repeats: int) -> dict:
    prompts = [_prompt(32, salt) for salt in range(batch)]
    free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=max_tokens, temperature=0, structured=StructuredSpec("json_schema", json.dumps(SCHEMA))
    )
    ids = itertools.count()
    decode_time(engine, prompts, free, ids), decode_time(engine, prompts, constrained, ids)  # warm-up
    runs = {"free": [], "grammar": []}
    tokens = {}
    for _ in range(repeats):
        for name, sampling in (("free", free), ("grammar", constrained)):
            seconds, n = decode_time(engine, prompts, sampling, ids)
            runs[name].append(seconds / n * 1e3)
            tokens[name] = n
    free_ms, grammar_ms = statistics.median(runs["free"]), statistics.median(runs["grammar"])
    return {
        "batch": batch,
        "free_ms_per_token": round(free_ms, 4),
        "grammar_ms_per_token": round(grammar_ms, 4),
        "ratio": round(grammar_ms / free_ms, 3),
        "free_tokens": tokens["free"],
        "grammar_tokens": tokens["grammar"],
    }


def mask_cost(engine: LLMEngine, batch: int, steps: int) -> float:
    """ms per token of the grammar work alone: mask the rows, pick a token, feed it (no model)."""
    from engine.grammar_mask import apply_grammar_masks

    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    grammars = [engine._structured_outputs().grammar(spec) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    vocab = engine.hf_config.vocab_size
    seconds, count = 0.0, 0
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        start = time.perf_counter()
        apply_grammar_masks(logits, grammars)
        for g, token in zip(grammars, logits.argmax(-1).tolist()):
            if not g.done:
                g.accept(token)
                count += 1
        seconds += time.perf_counter() - start
    return seconds / max(count, 1) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.grammar_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: build the benchmark model)")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny(tmp, BENCH_SPEC))
        engine = LLMEngine(
            EngineConfig(
                model=model,
                num_blocks=2048,
                block_size=16,
                max_num_seqs=64,
                max_num_batched_tokens=4096,
                num_threads=args.threads,
                device=args.device,
            )
        )
        rows = [measure(engine, int(b), args.tokens, args.repeats) for b in args.batch.split(",")]
        for r in rows:
            r["mask_only_ms_per_token"] = round(mask_cost(engine, r["batch"], args.tokens), 4)
    print(
        f"{'batch':>5} {'free ms/tok':>12} {'grammar ms/tok':>15} {'ratio':>6} {'tokens free/grammar':>20} "
        f"{'mask+feed ms/tok':>17}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['free_ms_per_token']:>12.3f} {r['grammar_ms_per_token']:>15.3f} "
            f"{r['ratio']:>6.2f} {r['free_tokens']:>10}/{r['grammar_tokens']:<9} "
            f"{r['mask_only_ms_per_token']:>17.4f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "bench-90M", "device": args.device, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
