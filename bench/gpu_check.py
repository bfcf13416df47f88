"""One prepared run for a GPU lease: is pdserve right on this device, how fast, and does a cluster serve.

    bash scripts/gpu-check.sh [--device cuda|cpu] [--out DIR] [--skip clusters,speed,...]

(the script installs the wheels of ``scripts/gpu-wheels.sh`` where the device has no registry, then runs
``python -m bench.gpu_check``). Five parts, each a list of rows in ``OUT/gpu-check.json``, and a table
printed last:

1. oracle: greedy tokens of the tiny Qwen3 and Llama models (and on CUDA the ~90M benchmark model),
   built here by ``make-model``, equal transformers ``generate`` on the same device in float32, on the
   Triton and the torch attention path; bfloat16 prompt log-probabilities within ``BF16_LOGPROB_TOL`` of
   float32's;
2. bandwidth: a device-to-device copy's bytes/s, the physical limit of a decode step;
3. speed: engine decode tok/s at batch 1/8/64 and prefill tok/s at 512/2048 tokens in bfloat16, Triton
   against torch against transformers ``generate``, and the batch-1 decode's share of the bandwidth
   (its weights read once per token);
4. clusters: a colocated and a 1P1D cluster on this one device over ZeroMQ, TTFT and TPOT through the
   router, and the KV transfer's bytes/s (the prefill server's own metric) against the copy;
5. tp: tensor parallelism 2 with NCCL where two GPUs are present (a row saying why not elsewhere).

``--device cpu`` runs the same parts small (the tiny model, a few tokens; Triton under its interpreter)
so the script works before a GPU is lent (tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

PARTS = ("oracle", "bandwidth", "speed", "clusters", "tp")
BF16_LOGPROB_TOL = 0.1  # nats, largest difference of a prompt token's log-probability from float32's
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    part: str
    name: str
    value: float | str | bool
    unit: str = ""
    ok: bool = True


@dataclass(frozen=True)
class Sizes:
    prompts: tuple[int, ...]  # oracle prompt lengths
    new_tokens: int
    batches: tuple[int, ...]  # decode batch sizes
    prefills: tuple[int, ...]  # prefill lengths
    decode_tokens: int
    copy_bytes: int
    requests: int  # per cluster


SIZES = {
    "cuda": Sizes((1, 7, 33, 100, 300), 16, (1, 8, 64), (512, 2048), 128, 1 << 30, 16),
    "cpu": Sizes((1, 7, 33), 6, (1, 8), (64,), 8, 64 << 20, 3),
}


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 * n + salt) % 500 + 3 for i in range(n)]


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def hf_model(path: str, device: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, exact_length: bool = False) -> list[list[int]]:
    """Greedy continuations from transformers ``generate``, one prompt at a time (no padding)."""
    import torch

    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        extra = {"min_new_tokens": new_tokens, "eos_token_id": None} if exact_length else {}
        with torch.no_grad():
            got = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens, **extra
            )
        out.append(got[0, len(p) :].tolist())
    return out


def engine(path: str, device: str, dtype: str, backend: str, **knobs):
    """An engine on ``backend``: auto, torch, triton, or triton+graphs (decode steps as CUDA graphs; on a
    CPU their padded buffers run eagerly, engine/decode_graphs.py)."""
    from engine import EngineConfig, LLMEngine

    graphs = backend == "triton+graphs"
    config = dict(block_size=16, num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=4096)
    knobs = {**config, **knobs, "cuda_graphs": graphs and device == "cuda"}
    eng = LLMEngine(
        EngineConfig(model=path, device=device, dtype=dtype, attention_backend=backend.split("+")[0], **knobs)
    )
    if graphs and device != "cuda":
        eng.runner.use_decode_graphs(eng.max_model_len, knobs["max_num_seqs"], capture=False)
    return eng


def prompt_logprobs(eng, prompt: list[int], sampling) -> list[float]:
    """The log-probability of each prompt token after the first, as the engine computed it."""
    eng.add_request("scored", prompt, sampling)
    entries = []
    while eng.has_unfinished():
        entries += [e.logprob for out in eng.step() for e in (out.prompt_logprobs or [])[1:] if e is not None]
    return entries


def check_oracle(models: dict[str, str], device: str, sizes: Sizes) -> list[Row]:
    from engine import SamplingParams

    rows = []
    prompts = [_prompt(n) for n in sizes.prompts]
    greedy = SamplingParams(max_tokens=sizes.new_tokens, temperature=0)
    for name, path in models.items():
        want = hf_generate(hf_model(path, device), prompts, sizes.new_tokens)
        for backend in ("triton", "triton+graphs", "torch"):
            eng = engine(path, device, "float32", backend, max_num_batched_tokens=64)  # chunked prefill too
            got = [r.token_ids for r in eng.generate(prompts, greedy)]
            same = sum(g == w for g, w in zip(got, want))
            rows.append(
                Row(
                    "oracle",
                    f"{name} float32 {backend}: prompts equal to transformers",
                    f"{same}/{len(want)}",
                    ok=same == len(want),
                )
            )
        scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        logprobs = {
            dtype: prompt_logprobs(engine(path, device, dtype, "auto"), prompts[-1], scored)
            for dtype in ("float32", "bfloat16")
        }
        diff = max(abs(a - b) for a, b in zip(logprobs["float32"], logprobs["bfloat16"]))
        rows.append(
            Row(
                "oracle",
                f"{name} bfloat16: largest prompt logprob difference from float32",
                round(diff, 4),
                "nats",
                diff <= BF16_LOGPROB_TOL,
            )
        )
    return rows


def check_bandwidth(device: str, sizes: Sizes) -> tuple[list[Row], float]:
    import torch

    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    rate = 2 * sizes.copy_bytes / best  # read and written
    return [
        Row("bandwidth", f"copy of {sizes.copy_bytes >> 20} MiB (read + write)", round(rate / 1e9, 1), "GB/s")
    ], rate


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def check_speed(path: str, device: str, sizes: Sizes, bandwidth: float) -> list[Row]:
    from engine import SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"
    rows = []
    for backend in ("triton", "triton+graphs", "torch"):
        eng = engine(path, device, dtype, backend)
        salt = iter(range(1, 1 << 30, 997))

        def run(batch: int, prompt_len: int, tokens: int, eng=eng, salt=salt) -> float:
            prompts = [_prompt(prompt_len, next(salt)) for _ in range(batch)]
            sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            return _timed(lambda: eng.generate(prompts, sampling))

        run(2, 32, 4)  # warm-up: kernels compiled
        for batch in sizes.batches:
            rate = batch * (sizes.decode_tokens - 1) / (run(batch, 64, sizes.decode_tokens) - run(batch, 64, 1))
            rows.append(Row("speed", f"decode batch {batch}, {dtype}, {backend}", round(rate, 1), "tok/s"))
            if batch == 1 and bandwidth > 0:
                weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
                share = weights * rate / bandwidth
                rows.append(
                    Row("speed", f"decode batch 1, {backend}: weight bytes/s over the copy's", float(f"{share:.3g}"))
                )
        for n in sizes.prefills:
            rows.append(Row("speed", f"prefill {n}, {dtype}, {backend}", round(n / run(1, n, 1), 1), "tok/s"))
        del eng
    model = hf_model(path, device, dtype)
    hf_generate(model, [_prompt(32)], 4)
    for batch in sizes.batches[:1]:  # generate pads a batch: one sequence is its fair case
        full = _timed(lambda: hf_generate(model, [_prompt(64, 5)], sizes.decode_tokens, exact_length=True))
        one = _timed(lambda: hf_generate(model, [_prompt(64, 6)], 1, exact_length=True))
        rows.append(
            Row(
                "speed",
                f"decode batch {batch}, {dtype}, transformers generate",
                round((sizes.decode_tokens - 1) / (full - one), 1),
                "tok/s",
            )
        )
    return rows


def check_clusters(path: str, device: str, sizes: Sizes, bandwidth: float, out: Path) -> list[Row]:
    import yaml

    from bench.load.cluster import free_port_pairs, launch
    from bench.load.loadgen import LoadConfig
    from bench.load.metrics import summarize
    from bench.load.prompts import PromptBuilder, load_tokenizer
    from bench.load.serve import discover_model, request_source, run_benchmark
    from bench.load.workload import Workload

    rows = []
    builder = PromptBuilder(load_tokenizer(Path(path)))
    for layout in ("colocated", "1p1d"):
        data = yaml.safe_load((REPO / "configs" / f"{layout}.yaml").read_text())
        data.update(model=path, device=device, dtype="bfloat16" if device == "cuda" else "float32")
        data["engine"] = {**(data.get("engine") or {}), "num_blocks": 2048}
        data["transfer"] = {"backend": "zmq"}  # NIXL is too large to carry to a leased device
        instances = [*data.get("prefill", []), *data.get("decode", []), *data.get("colocated", [])]
        ports = free_port_pairs(1 + len(instances))
        data["router"] = {**data["router"], "port": ports[0]}
        for inst, port in zip(instances, ports[1:]):
            inst.update(port=port, kv_port=port + 1)
        if layout == "colocated":
            data.pop("transfer")
            for inst in instances:
                inst.pop("kv_port")
        config = out / f"{layout}.yaml"
        config.write_text(yaml.safe_dump(data, sort_keys=False))
        started = time.perf_counter()
        cluster = launch(config, out / f"run-{layout}", sorted(os.sched_getaffinity(0)))
        try:
            rows.append(Row("clusters", f"{layout}: up", round(time.perf_counter() - started, 1), "s"))
            model = discover_model(cluster.url)[0]
            load = LoadConfig(url=cluster.url, model=model, concurrency=4, num_requests=sizes.requests, seed=1)
            source = request_source(Workload.single("256", "64"), builder, seed=1)
            summary = summarize(run_benchmark(load, source, progress=False).records)
            rows.append(Row("clusters", f"{layout}: requests failed", summary.failed, ok=summary.failed == 0))
            rows.append(Row("clusters", f"{layout}: TTFT p50", round(summary.ttft.p50 or 0.0, 1), "ms"))
            rows.append(Row("clusters", f"{layout}: TPOT p50", round(summary.tpot.p50 or 0.0, 2), "ms"))
            if layout == "1p1d":
                samples = cluster.samples("pdserve_transfer_")["p0"]
                moved = samples.get("pdserve_transfer_bytes_total", 0.0)
                seconds = samples.get("pdserve_transfer_seconds_sum", 0.0)
                rows.append(Row("clusters", "1p1d: KV bytes moved", int(moved), "B", moved > 0))
                if seconds > 0 and bandwidth > 0:
                    rows.append(
                        Row(
                            "clusters",
                            "1p1d: transfer bytes/s over the copy's",
                            float(f"{moved / seconds / bandwidth:.3g}"),
                        )
                    )
        finally:
            cluster.stop()
    return rows


def check_tp(models: dict[str, str], device: str, sizes: Sizes) -> list[Row]:
    import torch

    from engine import SamplingParams

    if device != "cuda" or torch.cuda.device_count() < 2:
        reason = "a CPU run" if device != "cuda" else f"{torch.cuda.device_count()} CUDA device(s)"
        return [Row("tp", "tensor parallel 2 (NCCL)", f"skipped: needs two CUDA devices, {reason}")]
    path = models["tiny-qwen3"]
    prompts = [_prompt(n) for n in sizes.prompts]
    want = hf_generate(hf_model(path, device), prompts, sizes.new_tokens)
    eng = engine(path, device, "float32", "auto", tensor_parallel_size=2)
    try:
        got = [r.token_ids for r in eng.generate(prompts, SamplingParams(max_tokens=sizes.new_tokens, temperature=0))]
    finally:
        eng.close()
    same = sum(g == w for g, w in zip(got, want))
    return [
        Row("tp", "tiny-qwen3 TP 2 float32: prompts equal to transformers", f"{same}/{len(want)}", ok=same == len(want))
    ]


def build_models(device: str, where: Path) -> dict[str, str]:
    from engine.make_model import TinySpec, make_tiny

    models = {
        "tiny-qwen3": str(make_tiny(where / "tiny-qwen3", TinySpec(arch="qwen3"))),
        "tiny-llama": str(make_tiny(where / "tiny-llama", TinySpec(arch="llama", seed=1))),
    }
    if device == "cuda":
        from bench.micro.engine_bench import BENCH_SPEC

        models["bench-90m"] = str(make_tiny(where / "bench-90m", BENCH_SPEC))
    return models


def format_table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'part':<10} {'check':<{width}}  value"]
    for r in rows:
        mark = "" if r.ok else "   <-- FAILED"
        lines.append(f"{r.part:<10} {r.name:<{width}}  {r.value} {r.unit}{mark}".rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bash scripts/gpu-check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the same parts, small (CI)")
    p.add_argument(
        "--out", default=os.environ.get("OUT") or "runs/gpu-check", help="folder of the JSON and logs (default $OUT)"
    )
    p.add_argument("--skip", default="", help=f"parts to leave out, comma-separated, of {','.join(PARTS)}")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(PARTS):
        p.error(f"--skip takes {', '.join(PARTS)}, not {', '.join(sorted(skip - set(PARTS)))}")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # Triton's kernels on a CPU: its interpreter, before they are defined
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (torch.cuda.is_available() is false); --device cpu runs it on CPU")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = SIZES[args.device]
    rows: list[Row] = []
    info = {"device": args.device, "torch": torch.__version__, "python": sys.version.split()[0]}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    print(f"gpu-check: {info}", flush=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        models = build_models(args.device, Path(tmp))
        bench_model = models.get("bench-90m", models["tiny-qwen3"])
        bandwidth = 0.0
        steps = [
            ("oracle", lambda: check_oracle(models, args.device, sizes)),
            ("bandwidth", lambda: check_bandwidth(args.device, sizes)),
            ("speed", lambda: check_speed(bench_model, args.device, sizes, bandwidth)),
            ("clusters", lambda: check_clusters(bench_model, args.device, sizes, bandwidth, out)),
            ("tp", lambda: check_tp(models, args.device, sizes)),
        ]
        for part, step in steps:
            if part in skip:
                rows.append(Row(part, "skipped (--skip)", ""))
                continue
            started = time.perf_counter()
            print(f"gpu-check: {part} ...", flush=True)
            try:
                result = step()
            except Exception as exc:  # one part's failure is a row; the parts after it still run
                traceback.print_exc()
                rows.append(Row(part, "raised", f"{type(exc).__name__}: {exc}"[:300], ok=False))
                continue
            if part == "bandwidth":
                result, bandwidth = result
            rows += result
            print(f"gpu-check: {part} done in {time.perf_counter() - started:.1f} s", flush=True)
    report = {"info": info, "ok": all(r.ok for r in rows), "rows": [asdict(r) for r in rows]}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    verdict = "all checks passed" if report["ok"] else "FAILED"
    print(f"\n{format_table(rows)}\n\ngpu-check: {verdict}; {out / 'gpu-check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
