"""What padding the projections' rows to a few sizes (engine/row_buckets.py) costs a prefill.

    python -m bench.micro.row_padding [--model smollm2] [--lengths 17,65,129,...] [--threads 1] \\
        [--rounds 5] [--json FILE]

One engine; each prompt length is prefilled three ways, in turn, the order rotated each round,
and the median of ``--rounds`` kept for each:

- ``served``: the rows padded as served, a count that padding would grow by more than a
  sixteenth cut into pieces first (``row_pieces``);
- ``one_piece``: the rows padded whole to their bucket (``row_pieces`` patched to one piece:
  how it was served before pieces);
- ``unpadded``: ``bucket_rows`` patched to return the rows unchanged (a new oneDNN kernel for
  every count).

The default lengths include the worst case of each octave (one row past a bucket: 129 rows
padded whole run as 160) and the steps of concurrent 1024-token prompts (1027: a prompt beside
three decodes; 2050: two beside two). Ratios: served / unpadded and one_piece / served (above 1,
the first costs that much more). With ``--threads 1`` the times are this thread's CPU time (what
the machine's other work takes from it is not counted), else wall time. The decode side, padded in
engine.native's DecodeLayer as well, is measured against an earlier checkout by
bench/micro/decode_step.py (``--against DIR``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

DEFAULT_LENGTHS = "17,40,65,100,129,200,257,400,513,700,1025,1027,1500,2000,2050"
SIDES = ("served", "one_piece", "unpadded")


def _prefill_ms(engine, length: int, salt: int, clock) -> float:
    from engine import SamplingParams

    prompt = [(31 * i + 7 * salt) % 500 + 3 for i in range(length)]
    engine.add_request(f"p{salt}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = clock()
    while engine.has_unfinished():
        engine.step()
    return 1000 * (clock() - start)


def _patch(side: str):
    if side == "one_piece":
        return mock.patch("engine.row_buckets.row_pieces", lambda rows: [rows])
    if side == "unpadded":
        return mock.patch("engine.row_buckets.bucket_rows", lambda rows: rows)
    return nullcontext()


def measure(model: str, lengths: list[int], threads: int, rounds: int) -> list[dict]:
    from engine import EngineConfig, LLMEngine
    from engine.models import MODEL_CACHE, resolve_model

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
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
    salt = 0
    rows = []
    for length in lengths:
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(rounds + 1):  # round 0 warms every shape up
            for side in SIDES[r % 3 :] + SIDES[: r % 3]:
                salt += 1
                with _patch(side):
                    ms = _prefill_ms(engine, length, salt, clock)
                if r:
                    times[side].append(ms)
        ms = {side: statistics.median(times[side]) for side in SIDES}
        rows.append(
            {"prompt_tokens": length}
            | {f"{side}_ms": ms[side] for side in SIDES}
            | {
                "served_vs_unpadded": ms["served"] / ms["unpadded"],
                "one_piece_vs_served": ms["one_piece"] / ms["served"],
            }
        )
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
    summary = {
        key: {"geomean": statistics.geometric_mean(r[key] for r in rows), "max": max(r[key] for r in rows)}
        for key in ("served_vs_unpadded", "one_piece_vs_served")
    }
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": rows, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
