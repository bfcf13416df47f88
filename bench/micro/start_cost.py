"""What starting a server costs: CPU seconds from spawn to its first HTTP answer, for the
router and a decode server of ``configs/tiny-1p1d.yaml``, in one or more checkouts,
alternated round by round (CPU time, not wall time: a shared machine inflates wall time,
not the work a start does).

    python -m bench.micro.start_cost --checkout /path/to/old --checkout . --rounds 3

Every test cluster and every restarted server pays this cost; the report gives each
checkout's median and its ratio to the first checkout.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import free_ports

ROLES = ("router", "decode")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a running process (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_config(folder: Path, checkout: Path) -> tuple[Path, dict[str, int]]:
    data = yaml.safe_load((checkout / "configs" / "tiny-1p1d.yaml").read_text())
    router, decode, decode_kv, prefill, prefill_kv = free_ports(5)
    data["router"]["port"] = router
    data["decode"][0].update(port=decode, kv_port=decode_kv)
    data["prefill"][0].update(port=prefill, kv_port=prefill_kv)
    path = folder / "start-cost.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, {"router": router, "decode": decode}


def measure(checkout: Path, role: str, config: Path, port: int, timeout: float) -> float:
    """CPU seconds ``role`` spends from spawn until it answers ``/health`` (any status)."""
    args = ["router"] if role == "router" else ["decode", "--name", "d0"]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", *args, "--config", str(config)],
        cwd=checkout,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{role} in {checkout} exited with status {proc.returncode}")
                try:
                    client.get(f"http://127.0.0.1:{port}/health")
                    return cpu_seconds(proc.pid)
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{role} in {checkout} did not answer in {timeout:.0f} s") from None
                    time.sleep(0.05)  # polling for the first answer, not synchronising
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.start_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", action="append", type=Path, help="a pdserve checkout (repeat; default: this one)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each starting every role in every checkout")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one start may take")
    args = parser.parse_args(argv)
    checkouts = [c.resolve() for c in args.checkout or [Path(__file__).resolve().parents[2]]]
    samples: dict[tuple[Path, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config, ports = write_config(Path(tmp), checkouts[0])
        for done in range(args.rounds):
            for checkout in checkouts:
                for role in ROLES:
                    samples.setdefault((checkout, role), []).append(
                        measure(checkout, role, config, ports[role], args.timeout)
                    )
            print(f"round {done + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print("| checkout | role | CPU s to first answer (median) | range | vs first checkout |")
    print("|---|---|---|---|---|")
    for role in ROLES:
        first = statistics.median(samples[(checkouts[0], role)])
        for checkout in checkouts:
            values = samples[(checkout, role)]
            median = statistics.median(values)
            print(
                f"| {checkout} | {role} | {median:.2f} | {min(values):.2f}-{max(values):.2f} | {median / first:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
