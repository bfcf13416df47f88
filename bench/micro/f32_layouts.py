"""What each float32 weight layout costs a projection, per row count: which one copy could serve them all.

    python -m bench.micro.f32_layouts [--models smollm2,qwen2.5-coder-0.5b] [--rows 1,2,4,8,16,64,256,512] \\
        [--projections qkv,gate_up] [--threads 1] [--rounds 5] [--min-ms 40] [--json FILE]

For each projection shape of each model (engine/model.py's fused qkv, o, gate_up, down and the lm_head,
[out, in]) and each row count, six ways to compute ``x [rows, in] @ W.T``:

- ``packed``: oneDNN's packed copy (``torch.ops.mkldnn._linear_pointwise``, rows not padded);
- ``io_matmul``: ``x @ W_io``, torch's matmul over the input-major [in, out] tensor;
- ``linear``: ``F.linear(x, W)`` over the [out, in] weight as loaded;
- ``gemv_f32``: engine.native's kernel over the input-major tensor (up to 8 rows, where it is built);
- ``onednn_io``: oneDNN's matmul (the op of ``packed``) over the input-major tensor's [out, in] view, unpacked;
- ``onednn_oi``: the same over the [out, in] weight as loaded.

Each is timed in turn, the order rotated every round, as the median over ``--rounds`` of the mean over
enough calls to take ``--min-ms``: of this thread's CPU time with ``--threads 1`` (so that time the
thread spends descheduled on a shared machine is not counted), else of wall time. Every cell is
microseconds per call, and each way's ratio to the fastest of them for that shape and row count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULT_ROWS = "1,2,4,8,16,64,256,512"
WAYS = ("packed", "io_matmul", "linear", "gemv_f32", "onednn_io", "onednn_oi")


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """The [out, in] of each projection engine/model.py builds for ``model`` (whole, not sharded)."""
    from engine.loader import head_dim_of, load_config
    from engine.models import MODEL_CACHE, resolve_model

    cfg = load_config(str(resolve_model(model, MODEL_CACHE)))
    hidden, dim = cfg.hidden_size, head_dim_of(cfg)
    q, kv = cfg.num_attention_heads * dim, cfg.num_key_value_heads * dim
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * cfg.intermediate_size, hidden),
        "down": (hidden, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, hidden),
    }


def _ways(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from engine import native

    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    w_io = weight.t().contiguous()
    ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "io_matmul": lambda x: x @ w_io,
        "linear": lambda x: F.linear(x, weight),
        "onednn_io": lambda x: torch.ops.mkldnn._linear_pointwise(x, w_io.t(), None, "none", [], ""),
        "onednn_oi": lambda x: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""),
    }
    gemv = native.kernel("gemv_f32")
    if gemv is not None and rows <= 8:
        ways["gemv_f32"] = lambda x: gemv(x, w_io.t(), None)
    return ways


def _us_per_call(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_ms: float, clock: Callable[[], float]
) -> float:
    calls, elapsed = 1, 0.0
    while True:
        start = clock()
        for _ in range(calls):
            fn(x)
        elapsed = clock() - start
        if elapsed * 1000 >= min_ms:
            return 1e6 * elapsed / calls
        calls *= 2


def measure(
    models: list[str],
    rows: list[int],
    rounds: int,
    min_ms: float,
    only: set[str] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    torch.manual_seed(0)
    results = []
    with torch.inference_mode():
        for model in models:
            for name, (out, inp) in shapes(model).items():
                if only and name not in only:
                    continue
                weight = torch.randn(out, inp) * inp**-0.5
                for n in rows:
                    x = torch.randn(n, inp)
                    ways = _ways(weight, n)
                    times: dict[str, list[float]] = {way: [] for way in ways}
                    order = list(ways)
                    for r in range(rounds + 1):  # round 0 warms every way up
                        for way in order[r % len(order) :] + order[: r % len(order)]:
                            us = _us_per_call(ways[way], x, min_ms, clock)
                            if r:
                                times[way].append(us)
                    median = {way: statistics.median(t) for way, t in times.items()}
                    best = min(median.values())
                    row = {"model": model, "proj": name, "out": out, "in": inp, "rows": n}
                    row.update({f"{way}_us": round(us, 1) for way, us in median.items()})
                    row.update({f"{way}_ratio": round(us / best, 3) for way, us in median.items()})
                    results.append(row)
                    print(json.dumps(row), flush=True)
    return results


def table(results: list[dict]) -> str:
    """Markdown: microseconds per call, each way's ratio to the fastest in brackets."""
    lines = ["| model | proj | rows | " + " | ".join(WAYS) + " |", "|" + "---|" * (3 + len(WAYS))]
    for row in results:
        cells = [f"{row[f'{way}_us']:.0f} ({row[f'{way}_ratio']:.2f})" if f"{way}_us" in row else "-" for way in WAYS]
        lines.append(f"| {row['model']} | {row['proj']} | {row['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.f32_layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help=f"row counts (default {DEFAULT_ROWS})")
    parser.add_argument("--projections", default="", help="only these projections (default all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-ms", type=float, default=40.0, help="time each cell over calls taking this long")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = set(args.projections.split(",")) if args.projections else None
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rows = [int(n) for n in args.rows.split(",")]
    results = measure(args.models.split(","), rows, args.rounds, args.min_ms, only, clock)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": args.threads, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
