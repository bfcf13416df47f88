"""Engine vs transformers on the same model, measured side by side in one run.

    python -m bench.micro.engine_bench [--model DIR] [--threads 2] [--json FILE]
    python -m bench.micro.engine_bench --tp 1,2 [--model DIR] [--threads 1]

With ``--tp`` it compares the engine with itself at each tensor-parallel size
instead (bench/micro/tp_bench.py).

Builds the ~90M benchmark model (12 layers, hidden 768, 12 heads, 4 KV heads)
when no --model is given. Each measurement alternates engine and HF runs
and keeps the median of --repeats, so both sides see the same machine noise;
the report gives ratios (engine / HF, higher is better for throughput).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import TinySpec, make_tiny

BENCH_SPEC = TinySpec(
    arch="qwen3",
    layers=12,
    hidden=768,
    heads=12,
    kv_heads=4,
    head_dim=64,
    intermediate=2048,
    vocab=16384,
    max_positions=4096,
    init_std=0.05,
)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(31 * i + 7 * salt) % 500 + 3 for i in range(n)]


class Bench:
    def __init__(self, model: str, threads: int, repeats: int) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.repeats = repeats
        self.engine = LLMEngine(
            EngineConfig(model=model, num_blocks=2048, block_size=16, max_num_seqs=64, max_num_batched_tokens=4096)
        )
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def _engine_generate(self, prompts, max_tokens) -> float:
        start = time.perf_counter()
        self.engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    def _hf_generate(self, prompts, max_tokens) -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.no_grad():
            self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
        return time.perf_counter() - start

    def _median_pair(self, fn_engine, fn_hf) -> tuple[float, float]:
        fn_engine(), fn_hf()  # warm-up
        e, h = [], []
        for _ in range(self.repeats):
            e.append(fn_engine())
            h.append(fn_hf())
        return statistics.median(e), statistics.median(h)

    def decode(self, batch: int, new_tokens: int = 64, prompt_len: int = 32) -> dict:
        prompts = [_prompt(prompt_len, s) for s in range(batch)]
        e_full, h_full = self._median_pair(
            lambda: self._engine_generate(prompts, new_tokens), lambda: self._hf_generate(prompts, new_tokens)
        )
        e_one, h_one = self._median_pair(
            lambda: self._engine_generate(prompts, 1), lambda: self._hf_generate(prompts, 1)
        )
        tokens = batch * (new_tokens - 1)
        e_tps, h_tps = tokens / (e_full - e_one), tokens / (h_full - h_one)
        return {"batch": batch, "engine_tok_s": e_tps, "hf_tok_s": h_tps, "ratio": e_tps / h_tps}

    def prefill(self, length: int) -> dict:
        prompts = [_prompt(length)]
        e, h = self._median_pair(lambda: self._engine_generate(prompts, 1), lambda: self._hf_generate(prompts, 1))
        return {"prompt_tokens": length, "engine_tok_s": length / e, "hf_tok_s": length / h, "ratio": h / e}

    def staggered(self, num: int = 32, gap_s: float = 0.05, hf_batch: int = 8) -> dict:
        """Requests arrive every gap_s with output lengths 16..64; HF serves static batches."""
        prompts = [_prompt(64, s) for s in range(num)]
        outs = [16 + (s * 13) % 49 for s in range(num)]
        useful = sum(outs)
        start = time.perf_counter()
        added = 0
        while added < num or self.engine.has_unfinished():
            now = time.perf_counter() - start
            while added < num and added * gap_s <= now:
                self.engine.add_request(
                    f"s{added}", prompts[added], SamplingParams(max_tokens=outs[added], temperature=0, ignore_eos=True)
                )
                added += 1
            if self.engine.has_unfinished():
                self.engine.step()
            else:
                time.sleep(min(gap_s, added * gap_s - now) if added < num else 0)
        engine_s = time.perf_counter() - start
        start = time.perf_counter()
        for b in range(0, num, hf_batch):
            arrival_of_last = (b + hf_batch - 1) * gap_s  # a static batch waits for its last member
            wait = arrival_of_last - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            self._hf_generate(prompts[b : b + hf_batch], max(outs[b : b + hf_batch]))
        hf_s = time.perf_counter() - start
        return {
            "requests": num,
            "useful_tokens": useful,
            "engine_tok_s": useful / engine_s,
            "hf_tok_s": useful / hf_s,
            "ratio": hf_s / engine_s,
        }

    def mixed_context_decode(self, short: int = 64, long: int = 2048, steps: int = 32) -> dict:
        """Decode steps of 3 short contexts next to 1 long one: padded per group of
        similar lengths (the engine) vs one batch padded to the longest."""
        import engine.attention as attention

        def step_time(min_extra: int) -> float:
            saved, attention.GROUP_MIN_EXTRA = attention.GROUP_MIN_EXTRA, min_extra
            try:
                sampling = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
                for i, n in enumerate((short, short, short, long)):
                    self.engine.add_request(f"mixed-{min_extra}-{i}", _prompt(n, i), sampling)
                self.engine.step()  # the prompts
                times = []
                while self.engine.has_unfinished():
                    start = time.perf_counter()
                    self.engine.step()
                    times.append(time.perf_counter() - start)
                return statistics.median(times)
            finally:
                attention.GROUP_MIN_EXTRA = saved

        grouped, padded = self._median_pair(lambda: step_time(attention.GROUP_MIN_EXTRA), lambda: step_time(1 << 30))
        return {
            "contexts": [short] * 3 + [long],
            "grouped_step_ms": 1000 * grouped,
            "one_padded_batch_step_ms": 1000 * padded,
            "ratio": grouped / padded,
        }


def peak_rss_smollm2(threads: int) -> dict:
    """Peak RSS of a fresh process that loads SmolLM2 (float32) and generates 32 tokens."""
    code = (
        "import resource,tempfile,torch;"
        "from engine.make_model import make_smollm2;from engine import *;"
        f"torch.set_num_threads({threads});d=tempfile.mkdtemp();make_smollm2(d);"
        "import gc;gc.collect();"
        "e=LLMEngine(EngineConfig(model=d,kv_cache_bytes=64<<20));"
        "e.generate([[1,2,3,4]],SamplingParams(max_tokens=32,temperature=0));"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {"peak_rss_mib_including_conversion": int(out.stdout.split()[-1]) / 1024}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder (default: build the ~90M benchmark model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per measurement (median)")
    parser.add_argument("--skip-rss", action="store_true", help="skip the SmolLM2 peak-RSS run")
    parser.add_argument("--json", help="write results to this file")
    parser.add_argument(
        "--tp",
        type=_sizes,
        help="comma-separated tensor-parallel sizes (e.g. 1,2): compare the engine at each, side by side, "
        "instead of against transformers; --threads is then per rank",
    )


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 1,2, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be 1 or more, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        model = str(make_tiny(Path(tempfile.mkdtemp()) / "bench90m", BENCH_SPEC))
    if args.tp:
        return _run_tp(model, args)
    bench = Bench(model, args.threads, args.repeats)
    results = {"model": model, "threads": args.threads, "decode": [], "prefill": []}
    for batch in (1, 8):
        results["decode"].append(bench.decode(batch))
        print(json.dumps(results["decode"][-1]), flush=True)
    for length in (512, 2048):
        results["prefill"].append(bench.prefill(length))
        print(json.dumps(results["prefill"][-1]), flush=True)
    results["staggered"] = bench.staggered()
    print(json.dumps(results["staggered"]), flush=True)
    results["mixed_context_decode"] = bench.mixed_context_decode()
    print(json.dumps(results["mixed_context_decode"]), flush=True)
    if not args.skip_rss:
        results["smollm2"] = peak_rss_smollm2(args.threads)
        print(json.dumps(results["smollm2"]), flush=True)
    results["this_process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _run_tp(model: str, args: argparse.Namespace) -> int:
    from bench.micro.tp_bench import measure, table

    rows = []
    for tp in args.tp:
        rows.append(measure(model, tp, args.threads, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "threads_per_rank": args.threads, "tp": rows}, indent=2))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m bench.micro.engine_bench") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
