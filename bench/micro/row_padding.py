"""What padding the projections' rows to a few sizes (engine/row_buckets.py) costs a prefill.

    python -m bench.micro.row_padding [--model smollm2] [--lengths 17,65,129,...] [--threads 1] \\
        [--rounds 5] [--json FILE]

One engine; each prompt length is prefilled with the rows padded (as served) and with
``bucket_rows`` patched to return the rows unchanged, the two in turn, the order reversed each
round, and the median of ``--rounds`` kept for each. The default lengths include the worst
case of each octave (one row past a bucket: 129 rows run as 160). ratio = padded ms / unpadded
ms: above 1, padding costs that much more. The decode side, padded in engine.native's
DecodeLayer as well, is measured against an earlier checkout by bench/micro/decode_step.py
(``--against DIR``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

DEFAULT_LENGTHS = "17,40,65,100,129,200,257,400,513,700,1025,1500,2000"


def _prefill_ms(engine, length: int, salt: int) -> float:
    from engine import SamplingParams

    prompt = [(31 * i + 7 * salt) % 500 + 3 for i in range(length)]
    engine.add_request(f"p{salt}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 1000 * (time.perf_counter() - start)


def measure(model: str, lengths: list[int], threads: int, rounds: int) -> list[dict]:
    from engine import EngineConfig, LLMEngine
    from engine.models import MODEL_CACHE, resolve_model

    torch.set_num_threads(threads)
    engine = LLMEngine(
        EngineConfig(
            model=str(resolve_model(model, MODEL_CACHE)),
            num_threads=threads,
            num_blocks=1024,
            block_size=16,
            max_num_batched_tokens=max(lengths),
            prefix_caching=False,
        )
    )
    unpadded = mock.patch("engine.row_buckets.bucket_rows", lambda rows: rows)
    salt = 0
    rows = []
    for length in lengths:
        times: dict[str, list[float]] = {"padded": [], "unpadded": []}
        for r in range(rounds + 1):  # round 0 warms both shapes up
            for side in ("padded", "unpadded") if r % 2 else ("unpadded", "padded"):
                salt += 1
                if side == "unpadded":
                    with unpadded:
                        ms = _prefill_ms(engine, length, salt)
                else:
                    ms = _prefill_ms(engine, length, salt)
                if r:
                    times[side].append(ms)
        padded, plain = statistics.median(times["padded"]), statistics.median(times["unpadded"])
        rows.append({"prompt_tokens": length, "padded_ms": padded, "unpadded_ms": plain, "ratio": padded / plain})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.row_padding",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="a built-in model name or a folder (default smollm2)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"prompt lengths (default {DEFAULT_LENGTHS})")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = measure(args.model, lengths, args.threads, args.rounds)
    ratios = [row["ratio"] for row in rows]
    summary = {"geomean_ratio": statistics.geometric_mean(ratios), "max_ratio": max(ratios)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": rows, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
