"""``python -m bench.peer``: pdserve against vLLM's CPU build, one system at a time on the same cores.

    python -m bench.peer [--model smollm2] [--cpus 0,1] [--rounds 2] [--dtypes float32,bfloat16] \\
        [--systems vllm-colocated,vllm-pd,pdserve-colocated,pdserve-1p1d] [--workloads 1x5,8x32,2x8,4x16] \\
        [--noise N] [--slo-ttft-ms 2000 --slo-tpot-ms 100] [--vllm-pd-split-cores] \\
        [--pdserve-dir DIR] [--out runs/peer]

Systems: vLLM colocated (one ``vllm.entrypoints.openai.api_server``), vLLM's P/D split (a prefill and a
decode server with the NixlConnector, ``kv_buffer_device: cpu``, behind ``vllm-router
--vllm-pd-disaggregation``), pdserve colocated and pdserve 1P1D (configs/colocated.yaml and
configs/1p1d.yaml with the model, dtype and a thread per core). vLLM is installed once into its own
venv under ``--cache`` (bench/peer/vllm.py). Each round starts every system in turn (the order
reversed on odd rounds), warms it with one request of each workload, loads it with the
``pdserve bench serve`` client (every system gets the same prompts: the seed is the round's and the
workload's), and stops it by pid before the next starts. ``--noise N`` runs N single-threaded busy loops
on the same cores while a system is measured.

Writes ``peer.json`` (every sample, the load average before each system, the medians and ratios) and
prints the markdown tables: output tok/s, TTFT, TPOT and ITL p50 and goodput at the SLO per workload,
dtype and system, and pdserve / vLLM per pair (colocated with colocated, 1P1D with the P/D split).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.cpu_anchor import cluster_config, ordered
from bench.load.cluster import ClusterError, cpu_list, free_ports, launch
from bench.load.loadgen import LoadConfig
from bench.load.metrics import Summary, summarize
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.serve import request_source, run_benchmark
from bench.load.workload import Workload as LoadWorkload
from bench.peer import vllm
from bench.peer.report import (
    PDSERVE_1P1D,
    PDSERVE_COLOCATED,
    SYSTEMS,
    VLLM_COLOCATED,
    VLLM_PD,
    WORKLOADS,
    Sample,
    Workload,
    format_tables,
    goodput_samples,
    rows,
    rows_to_json,
)

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked; lists come back as lists, workloads as :class:`Workload`."""
    p = argparse.ArgumentParser(
        prog="python -m bench.peer",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Not part of CI: the first run installs vLLM (about 4 GB) into --cache.",
    )
    p.add_argument("--model", default="smollm2", help="a model folder or a built-in name (default: smollm2)")
    p.add_argument("--cpus", default=None, help="cores for every system, e.g. 0,1 (default: all this process may use)")
    p.add_argument("--rounds", type=int, default=2, help="rounds; the systems' order is reversed on odd ones (2)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16 (both)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    names = ",".join(w.name.split()[0] for w in WORKLOADS)
    p.add_argument("--workloads", default=names, help=f"streams x requests of the table's rows ({names})")
    p.add_argument("--noise", type=int, default=0, help="busy loops beside the server while it is measured (0)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT bound (2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput's TPOT bound (100)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed; round r, workload i use seed + 1000 r + i")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE per server (1)")
    p.add_argument(
        "--vllm-pd-split-cores",
        action="store_true",
        help="vLLM's P/D split with the prefill server on the first half of the cores, decode on the rest "
        "(default: both on all, as pdserve 1P1D)",
    )
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a system may take to start (900)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (300)")
    p.add_argument(
        "--pdserve-dir",
        type=Path,
        default=None,
        help="the pdserve checkout whose servers run (default: this one), e.g. an export of a commit",
    )
    p.add_argument("--cache", default=vllm.DEFAULT_CACHE, help=f"where vLLM's venv is kept ({vllm.DEFAULT_CACHE})")
    p.add_argument("--out", default="runs/peer", help="folder for peer.json, configs and logs (runs/peer)")
    args = p.parse_args(argv)
    try:
        args.dtypes = [DTYPES[d] for d in _list(args.dtypes)]
    except KeyError as exc:
        p.error(f"--dtypes: float32 or bfloat16, comma-separated (got {exc})")
    args.systems = _list(args.systems)
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        p.error(f"--systems: a subset of {', '.join(SYSTEMS)} (got {args.systems})")
    by_key = {w.name.split()[0]: w for w in WORKLOADS}
    picked = _list(args.workloads)
    if not picked or any(k not in by_key for k in picked):
        p.error(f"--workloads: a subset of {', '.join(by_key)} (got {args.workloads!r})")
    args.workloads = [by_key[k] for k in picked]
    if not args.dtypes:
        p.error("--dtypes: at least one")
    if args.pdserve_dir is not None:
        args.pdserve_dir = args.pdserve_dir.resolve()
    if args.rounds < 1 or args.noise < 0:
        p.error("--rounds must be >= 1 and --noise >= 0")
    return args


# ---- the systems ----------------------------------------------------------------------------


@dataclass
class Running:
    """A started system: where to send requests, the model name it serves, and how to stop it."""

    url: str
    model: str
    stop: Callable[[], object]


def pdserve_config(layout: str, model_dir: Path, dtype: str, threads: int) -> dict:
    """configs/<layout>.yaml as shipped, with the model folder, dtype, a thread per core and free ports."""
    return cluster_config(layout, model_dir, dtype, threads)


def start_system(
    system: str,
    args: argparse.Namespace,
    env: vllm.VllmEnv | None,
    model_dir: Path,
    dtype: str,
    cores: list[int],
    out: Path,
) -> Running:
    """Starts one system on ``cores``; raises VllmError or ClusterError (with the reason) if it cannot."""
    if system in (PDSERVE_COLOCATED, PDSERVE_1P1D):
        layout = "colocated" if system == PDSERVE_COLOCATED else "1p1d"
        path = out / f"{system}-{dtype}.yaml"
        path.write_text(yaml.safe_dump(pdserve_config(layout, model_dir, dtype, len(cores)), sort_keys=False))
        cluster = launch(path, out / f"run-{system}-{dtype}", cores, args.start_timeout, args.pdserve_dir)
        return Running(cluster.url, cluster.model, cluster.stop)
    assert env is not None
    logs = out / f"run-{system}-{dtype}"
    if system == VLLM_COLOCATED:
        started = vllm.start_colocated(
            env, model_dir, dtype, cores, free_ports(1), logs, args.vllm_kv_cache_gib, args.start_timeout
        )
    else:
        started = vllm.start_pd(
            env,
            model_dir,
            dtype,
            cores,
            free_ports(5),
            logs,
            args.vllm_kv_cache_gib,
            args.start_timeout,
            args.vllm_pd_split_cores,
        )
    return Running(started.url, model_dir.name, started.stop)


def start_noise(count: int, cores: list[int]) -> list[subprocess.Popen]:
    """``count`` busy loops (bench.micro.noisy_neighbour's) pinned to ``cores``."""
    from bench.micro.noisy_neighbour import busy_loop

    loops = []
    for _ in range(count):
        loop = busy_loop()
        os.sched_setaffinity(loop.pid, cores)
        loops.append(loop)
    return loops


def stop_noise(loops: list[subprocess.Popen]) -> None:
    for loop in loops:
        loop.kill()
        loop.wait()


def measure(
    url: str, model: str, workload: Workload, seed: int, builder: PromptBuilder, args: argparse.Namespace
) -> Summary:
    """One warm-up request (not counted), then the workload; its summary with the SLO's goodput."""
    config = LoadConfig(
        url=url,
        model=model,
        concurrency=workload.concurrency,
        num_requests=workload.requests,
        request_timeout=args.request_timeout,
        seed=seed,
    )
    source = request_source(LoadWorkload.single(str(workload.prompt), str(workload.output)), builder, seed=seed)
    result = run_benchmark(config, source, warmup=1, progress=False)
    return summarize(result.records, result.duration_s, args.slo_ttft_ms, args.slo_tpot_ms)


def measure_system(
    running: Running,
    system: str,
    dtype: str,
    round_index: int,
    builder: PromptBuilder,
    args: argparse.Namespace,
    errors: dict[str, dict[str, int]],
) -> list[Sample]:
    """Every workload on one started system, in order; failed requests counted into ``errors`` by reason."""
    samples = []
    for i, workload in enumerate(args.workloads):
        seed = args.seed + 1000 * round_index + i
        summary = measure(running.url, running.model, workload, seed, builder, args)
        sample = Sample.of(workload.name, dtype, system, round_index, summary)
        samples.append(sample)
        mine = errors.setdefault(system, {})
        for reason, count in summary.errors.items():
            mine[reason] = mine.get(reason, 0) + count
        print(
            f"   {workload.name}: {sample.output_tok_s:.1f} tok/s, TTFT p50 {sample.ttft_p50_ms or 0:.0f} ms, "
            f"TPOT p50 {sample.tpot_p50_ms or 0:.1f} ms, ITL p50 {sample.itl_p50_ms or 0:.1f} ms, "
            f"failed {sample.failed}",
            flush=True,
        )
        if sample.completed == 0:
            break  # the system is down; the next round starts it afresh
    return samples


# ---- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from engine.models import MODEL_CACHE, resolve_model

    try:
        cores = cpu_list(args.cpus)
        model_dir = resolve_model(args.model, MODEL_CACHE)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()  # the servers may run from another folder (--pdserve-dir)
    out.mkdir(parents=True, exist_ok=True)
    env = None
    not_started: dict[str, str] = {}
    if any(s in (VLLM_COLOCATED, VLLM_PD) for s in args.systems):
        try:
            env = vllm.install(Path(args.cache).expanduser())
        except vllm.VllmError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if VLLM_PD in args.systems and (problem := vllm.pd_problem(env)) is not None:
            not_started[VLLM_PD] = problem
    builder = PromptBuilder(load_tokenizer(model_dir))
    samples: list[Sample] = []
    runs: list[dict] = []
    errors: dict[str, dict[str, int]] = {}
    for dtype in args.dtypes:
        for r in range(args.rounds):
            for system in ordered(args.systems, r):
                key = f"{system} {dtype}"
                if system in not_started or key in not_started:
                    continue
                load = os.getloadavg()
                print(f"== {dtype} round {r + 1}/{args.rounds}: {system} (load average {load[0]:.2f})", flush=True)
                began = time.monotonic()
                try:
                    running = start_system(system, args, env, model_dir, dtype, cores, out)
                except (vllm.VllmError, ClusterError) as exc:
                    print(f"   {system} did not start: {exc}", file=sys.stderr, flush=True)
                    not_started[key] = str(exc)
                    continue
                runs.append(
                    {
                        "dtype": dtype,
                        "round": r,
                        "system": system,
                        "loadavg": load,
                        "start_s": round(time.monotonic() - began, 1),
                    }
                )
                loops = start_noise(args.noise, cores)
                try:
                    samples += measure_system(running, system, dtype, r, builder, args, errors)
                finally:
                    stop_noise(loops)
                    running.stop()
    samples += goodput_samples(samples)
    names = [w.name for w in args.workloads]
    table_rows = rows(samples, args.systems, args.dtypes, names)
    failures = {system: sum(reasons.values()) for system, reasons in errors.items()}
    report = {
        "command": ["python", "-m", "bench.peer", *sys.argv[1:]],
        "model": str(model_dir),
        "cpus": cores,
        "rounds": args.rounds,
        "dtypes": args.dtypes,
        "systems": args.systems,
        "workloads": names,
        "noise": args.noise,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "vllm": {
            "version": vllm.VERSION,
            "venv": str(env.venv) if env else None,
            "kv_cache_gib": args.vllm_kv_cache_gib,
            "pd_split_cores": args.vllm_pd_split_cores,
        },
        "pdserve_dir": str(args.pdserve_dir or Path(__file__).resolve().parents[2]),
        "not_started": not_started,
        "runs": runs,
        "errors": errors,
        "samples": [s.to_json() for s in samples],
        "rows": rows_to_json(table_rows),
    }
    path = out / "peer.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(format_tables(table_rows, failures))
    for what, why in not_started.items():
        print(f"\nnot measured: {what}: {why.splitlines()[0]}")
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))
