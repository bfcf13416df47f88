"""The engine at several tensor-parallel sizes, side by side in one run (``pdserve bench engine --tp 1,2``).

For each size: decode tokens/s (a batch decoding together), prefill tokens/s
(one long prompt), the median decode step, and the share of rank 0's step
time spent in the model's collectives (two all-reduces a layer and the
logits' gather: on CPU with gloo that includes waiting for the slowest rank).
``--threads`` is per rank, so a size of N uses N times as many cores: on a
machine with fewer cores than that the ranks share them and the numbers show
the cost of the split, not its gain.
"""

from __future__ import annotations

import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt) % 500 + 3 for i in range(n)]


def _collective_seconds(engine: LLMEngine) -> float:
    return 0.0 if engine.ranks is None else engine.ranks.group.collective_seconds


def _timed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], float]:
    """(seconds, each step's seconds, seconds in collectives) to generate ``max_tokens`` for every prompt."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, sampling)
    steps = []
    collective = _collective_seconds(engine)
    start = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return time.perf_counter() - start, steps, _collective_seconds(engine) - collective


def measure(model: str, tp: int, threads: int, repeats: int, batch: int = 8, new_tokens: int = 32) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=model,
            tensor_parallel_size=tp,
            num_threads=threads,
            num_blocks=1024,
            block_size=16,
            max_num_batched_tokens=4096,
            prefix_caching=False,
        )
    )
    try:
        prompts = [_prompt(32, s) for s in range(batch)]
        _timed(engine, prompts, 2)  # warm-up
        decode, prefill = [], []
        for _ in range(repeats):
            total, steps, collective = _timed(engine, prompts, new_tokens)
            decode_steps = steps[1:]  # the first step computes the prompts
            tok_s = batch * (new_tokens - 1) / sum(decode_steps)
            decode.append((tok_s, statistics.median(decode_steps), collective / total))
            seconds, _, prefill_collective = _timed(engine, [_prompt(1024, 99)], 1)
            prefill.append((1024 / seconds, prefill_collective / seconds))
        engine.check_integrity()
        return {
            "tp": tp,
            "decode_tok_s": statistics.median(d[0] for d in decode),
            "decode_step_ms": 1000 * statistics.median(d[1] for d in decode),
            "decode_collective_share": statistics.median(d[2] for d in decode),
            "prefill_tok_s": statistics.median(p[0] for p in prefill),
            "prefill_collective_share": statistics.median(p[1] for p in prefill),
        }
    finally:
        engine.close()


def table(rows: list[dict]) -> str:
    head = "| TP | decode tok/s | decode step ms | collectives in decode | prefill tok/s | collectives in prefill |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['tp']} | {r['decode_tok_s']:.1f} | {r['decode_step_ms']:.1f} | "
            f"{100 * r['decode_collective_share']:.0f}% | {r['prefill_tok_s']:.1f} | "
            f"{100 * r['prefill_collective_share']:.0f}% |"
        )
    return "\n".join(lines)
