"""Soak: a steady request mix for a bounded time, every process's memory, fds, threads and bookkeeping
sampled, and a verdict on whether anything grows.

    python -m bench.load.soak --layout 1p1d --duration-s 900 --out runs/soak-1p1d
    python -m bench.load.soak --layout 2p2d --duration-s 900 --restart-decode-at 300 --out runs/soak-2p2d
    python -m bench.load.soak --run-dir runs/<launch> --duration-s 600 --out runs/soak   # a launched cluster

``--layout`` starts ``pdserve launch`` on a config of the built-in tiny model on free ports of
127.0.0.1 (restart on failure) and stops it afterwards; ``--config FILE`` launches that file as it
is; ``--run-dir`` uses a cluster someone launched (its ``cluster.json`` and ``internal_secret``).
``--clients`` threads send the mix (``bench/load/soak_mix.py``) until ``--duration-s``; every
``--interval-s`` each process is sampled (``bench/load/soak_sample.py``). ``--restart-decode-at S``
kills the first decode server with kill -9 S seconds in (the launcher restarts it); errors within
``--fault-window-s`` after it are counted apart. Once the load stops, the soak waits until no
per-request bookkeeping is left and fds and threads are back to their idle numbers, taken before the
load started and after ``--prime-s`` of the same load (the first requests open what a server keeps
open for good: its connection to each peer, the transfer backend's sockets, worker threads).

Printed and written to ``OUT/soak.json``: requests and errors by kind, each process's RSS slope
after ``--warmup-s`` with its verdict against ``--bound-mb-per-h``, what was left after the load;
``OUT/rss.png``: RSS, fds and threads over time. Exit status 1 when a verdict fails.
``--tracemalloc N`` turns on each server's tracemalloc (N frames, ``POST /debug/tracemalloc/start``)
before the load and saves its growth (``GET /debug/tracemalloc``, server_common/heap_debug.py) every
``--tracemalloc-every-s`` into ``OUT/tracemalloc/`` (memory figures then include the tracing's own cost).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import RunningCluster, cpu_list, free_port_pairs, free_ports, launch
from bench.load.soak_mix import DEFAULT_MIX, MixLoad, parse_mix
from bench.load.soak_sample import Sample, as_rows, read_manifest, sample, settle, slopes


def layout_config(folder: Path, prefill: int, decode: int) -> Path:
    """``prefill`` + ``decode`` servers of the tiny model on free ports, as configs/tiny-1p1d.yaml has them."""
    pairs = free_port_pairs(prefill + decode)
    config = {
        "model": "tiny",
        "engine": {"num_threads": 1, "num_blocks": 512},
        "router": {"port": free_ports(1)[0], "health_interval_s": 0.5},
        "lease_s": 10,
        "transfer": {"backend": "zmq"},
        "restart": {"backoff_s": 0.2},
        "prefill": [{"name": f"p{i}", "port": pairs[i], "block_size": 4} for i in range(prefill)],
        "decode": [
            {"name": f"d{i}", "port": pairs[prefill + i], "block_size": 16, "kv_layout": "NHD" if i % 2 else "HND"}
            for i in range(decode)
        ],
    }
    path = folder / f"soak-{prefill}p{decode}d.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def secret_headers(run_dir: Path) -> dict[str, str]:
    secret = run_dir / "internal_secret"  # pdserve launch's
    return {"authorization": f"Bearer {secret.read_text().strip()}"} if secret.is_file() else {}


def start_tracing(run_dir: Path, http: httpx.Client, headers: dict[str, str], frames: int) -> None:
    for proc in read_manifest(run_dir)["processes"]:
        if proc["role"] != "router":
            url = proc["url"] + "/debug/tracemalloc/start"
            http.post(url, params={"frames": frames}, headers=headers).raise_for_status()


def save_heap_growth(run_dir: Path, http: httpx.Client, headers: dict[str, str], out: Path, t: float) -> None:
    """Each server's ``/debug/tracemalloc`` (growth since the last call) into ``OUT/tracemalloc/``."""
    folder = out / "tracemalloc"
    folder.mkdir(exist_ok=True)
    for proc in read_manifest(run_dir)["processes"]:
        if proc["role"] == "router":
            continue
        try:
            resp = http.get(proc["url"] + "/debug/tracemalloc", params={"top": 40}, headers=headers, timeout=300)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            (folder / f"{proc['name']}-{int(t):05d}s.json").write_text(json.dumps(resp.json(), indent=1))


def plot(samples: list[Sample], path: Path, warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name in dict.fromkeys(s.name for s in samples):
        mine = [s for s in samples if s.name == name]
        minutes = [s.t / 60 for s in mine]
        for ax, values in zip(axes, ([s.rss_mb for s in mine], [s.fds for s in mine], [s.threads for s in mine])):
            ax.plot(minutes, values, label=name, marker=".", markersize=3)
    for ax, label in zip(axes, ("RSS (MB)", "open fds", "threads")):
        ax.set_ylabel(label)
        ax.axvline(warmup_s / 60, color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", ncol=4)
    axes[-1].set_xlabel("minutes of load (before 0: the cluster fresh, then the priming load; dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out or tempfile.mkdtemp(prefix="pdserve-soak-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cluster: RunningCluster | None = None
    if args.run_dir:
        run_dir = Path(args.run_dir).resolve()
    else:
        config = Path(args.config).resolve() if args.config else layout_config(out, *_layout(args.layout))
        run_dir = out / "run"
        cluster = launch(config, run_dir, cpu_list(args.cpus))
    try:
        return _soak(args, run_dir, out)
    finally:
        if cluster is not None:
            cluster.stop()


def _layout(text: str) -> tuple[int, int]:
    prefill, _, decode = text.lower().removesuffix("d").partition("p")
    return int(prefill), int(decode)


def _soak(args: argparse.Namespace, run_dir: Path, out: Path) -> dict:
    manifest = read_manifest(run_dir)
    headers = secret_headers(run_dir)
    samples: list[Sample] = []
    t0 = time.monotonic()
    with httpx.Client(timeout=30.0) as http:
        fresh = sample(run_dir, http, headers, 0.0)  # before any request
        if args.prime_s > 0:  # connections, peers and thread pools that the first requests open stay open
            primer = MixLoad(manifest["router_url"], manifest["model"], parse_mix(args.mix), args.clients, seed=-1)
            primer.start()
            time.sleep(args.prime_s)  # the priming load's length, not a synchronisation
            primer.stop()
        idle, _, _ = settle(run_dir, http, headers, [], t0, args.settle_s)
        primed = time.monotonic() - t0
        t0 = time.monotonic()
        for s in fresh:
            s.t = -primed  # before the priming load: the plot starts there
        for s in idle:
            s.t = 0.0
        samples += fresh + idle
        if args.tracemalloc:
            start_tracing(run_dir, http, headers, args.tracemalloc)
            save_heap_growth(run_dir, http, headers, out, 0.0)  # the first snapshot, to compare with
        load = MixLoad(
            manifest["router_url"],
            manifest["model"],
            parse_mix(args.mix),
            args.clients,
            seed=args.seed,
            pause_s=args.pause_s,
        )
        load.start()
        fault_at: float | None = None
        next_sample, next_heap = args.interval_s, args.tracemalloc_every_s
        try:
            while (now := time.monotonic() - t0) < args.duration_s:
                if args.restart_decode_at is not None and fault_at is None and now >= args.restart_decode_at:
                    victim = next(p for p in read_manifest(run_dir)["processes"] if p["role"] == "decode")
                    os.kill(victim["pid"], signal.SIGKILL)
                    fault_at = now
                    print(f"soak: {now:.0f} s: killed {victim['name']} (pid {victim['pid']})", flush=True)
                if now >= next_sample:
                    batch = sample(run_dir, http, headers, now)
                    samples += batch
                    next_sample += args.interval_s
                    rss = ", ".join(f"{s.name} {s.rss_mb:.1f}" for s in batch)
                    print(
                        f"soak: {now / 60:5.1f} min, {load.tally.total()} requests, {load.tally.errors()} errors; "
                        f"RSS MB: {rss}",
                        flush=True,
                    )
                if args.tracemalloc and now >= next_heap:
                    save_heap_growth(run_dir, http, headers, out, now)
                    next_heap += args.tracemalloc_every_s
                time.sleep(0.2)  # the soak's clock, not a synchronisation
        finally:
            load.stop()
        stopped = time.monotonic() - t0
        warm = [s for s in samples if s.t <= args.warmup_s]
        final, left, over = settle(run_dir, http, headers, idle, t0, args.settle_s, warm)
        if args.tracemalloc:
            save_heap_growth(run_dir, http, headers, out, time.monotonic() - t0)
    samples += final
    fitted = slopes([s for s in samples if s.t <= stopped], args.warmup_s, args.bound_mb_per_h)
    in_window = [
        e for e in load.tally.errors_at if fault_at is not None and 0 <= e[0] - t0 - fault_at <= args.fault_window_s
    ]
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, result), n in sorted(load.tally.counts.items()):
        by_kind.setdefault(kind, {})[result] = n
    result = {
        "run_dir": str(run_dir),
        "duration_s": round(stopped, 1),
        "clients": args.clients,
        "mix": args.mix,
        "requests": load.tally.total(),
        "errors": load.tally.errors(),
        "errors_in_fault_window": len(in_window),
        "fault_at_s": fault_at,
        "by_kind": by_kind,
        "warmup_s": args.warmup_s,
        "bound_mb_per_h": args.bound_mb_per_h,
        "slopes": [{**vars(s), "verdict": s.verdict} for s in fitted],
        "fresh": {s.name: {"fds": s.fds, "threads": s.threads, "rss_mb": round(s.rss_mb, 1)} for s in fresh},
        "idle": {s.name: {"fds": s.fds, "threads": s.threads, "rss_mb": round(s.rss_mb, 1)} for s in idle},
        "after": {s.name: {"fds": s.fds, "threads": s.threads, "rss_mb": round(s.rss_mb, 1)} for s in final},
        "bookkeeping_after": {s.name: s.book for s in final},
        "left_after_load": left,
        "over_idle_after_load": {k: {m: list(v) for m, v in d.items()} for k, d in over.items()},
    }
    result["ok"] = (
        all(s.verdict == "flat" for s in fitted)
        and not left
        and not over
        and result["errors"] == result["errors_in_fault_window"]
    )
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "samples.json").write_text(json.dumps(as_rows(samples)) + "\n")
    plot([s for s in samples if s.t <= stopped], out / "rss.png", args.warmup_s)
    return result


def report(result: dict) -> str:
    lines = [
        f"soak: {result['requests']} requests in {result['duration_s'] / 60:.1f} min, {result['errors']} errors"
        + (
            f" ({result['errors_in_fault_window']} within the fault window)" if result["fault_at_s"] is not None else ""
        ),
        f"RSS slope after {result['warmup_s'] / 60:.0f} min of warm-up (bound {result['bound_mb_per_h']} MB/h):",
    ]
    for s in result["slopes"]:
        idle, after = result["idle"].get(s["name"], {}), result["after"].get(s["name"], {})
        fresh = result["fresh"].get(s["name"], {}).get("rss_mb", 0.0)
        lines.append(
            f"  {s['name']:<8} {s['mb_per_hour']:+8.2f} MB/h  {s['first_mb']:.1f} -> {s['last_mb']:.1f} MB "
            f"(before any request {fresh:.1f}) "
            f"({s['samples']} samples)  {s['verdict']};  fds {idle.get('fds')} -> {after.get('fds')}, "
            f"threads {idle.get('threads')} -> {after.get('threads')} (idle -> after load)"
        )
    lines.append(f"per-request bookkeeping left after the load: {result['left_after_load'] or 'none'}")
    lines.append(f"fds or threads above idle after the load: {result['over_idle_after_load'] or 'none'}")
    lines.append("verdict: " + ("ok" if result["ok"] else "FAILED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.soak", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--layout", default="1p1d", help="start the tiny model as NpMd on free ports (default 1p1d)")
    where.add_argument("--config", help="start this cluster config with pdserve launch")
    where.add_argument("--run-dir", help="a cluster started by pdserve launch: its run folder")
    parser.add_argument("--out", help="where soak.json, samples.json and rss.png go (default: a new temp folder)")
    parser.add_argument("--duration-s", type=float, default=900.0, help="seconds of load (default 900)")
    parser.add_argument("--warmup-s", type=float, default=300.0, help="left out of the slopes (default 300)")
    parser.add_argument("--interval-s", type=float, default=30.0, help="seconds between samples (default 30)")
    parser.add_argument("--bound-mb-per-h", type=float, default=5.0, help="the slope a flat process stays under")
    parser.add_argument("--clients", type=int, default=4, help="client threads (default 4)")
    parser.add_argument("--pause-s", type=float, default=0.0, help="each client's wait between requests (default 0)")
    parser.add_argument("--mix", default=DEFAULT_MIX, help=f"KIND=WEIGHT,... (default {DEFAULT_MIX})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restart-decode-at", type=float, help="kill -9 the first decode server this many s in")
    parser.add_argument(
        "--fault-window-s", type=float, default=60.0, help="errors this long after the kill are the fault's"
    )
    parser.add_argument(
        "--prime-s", type=float, default=20.0, help="load before the idle numbers are taken (default 20)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=60.0, help="after the load, how long things may take to go idle"
    )
    parser.add_argument("--tracemalloc", type=int, default=0, help="trace the servers' allocations, N frames (0: off)")
    parser.add_argument("--tracemalloc-every-s", type=float, default=120.0)
    parser.add_argument("--cpus", help="cores for a cluster it starts, e.g. 0-1 (default: all this process may use)")
    args = parser.parse_args(argv)
    result = run(args)
    print(report(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
