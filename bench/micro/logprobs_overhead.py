"""What log-probabilities cost per generated token through the router, side by side in one run.

    python -m bench.micro.logprobs_overhead [--model DIR] [--config configs/tiny-1p1d.yaml] [--tokens 32]
                                            [--repeats 5] [--concurrency 4] [--json FILE]

Launches the config's cluster (the tiny test model when no --model is given), then each repeat
sends the same batch of greedy, ignore_eos completions with and without ``logprobs=5`` (a
different one first each time, so both share the machine's noise) and keeps the median
seconds per generated token of each. The ratio is with / without: 1.0 means no overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.load.cluster import free_ports, launch

PROMPT = "A prefill server computes the prompt; a decode server streams the answer one token at a time."
VARIANTS = {"plain": {}, "logprobs=5": {"logprobs": 5}}


def write_config(template: Path, model: str, folder: Path) -> Path:
    data = yaml.safe_load(template.read_text())
    data["model"], data["served_model_name"] = model, "bench"
    instances = [i for role in ("prefill", "decode", "colocated") for i in data.get(role) or []]
    ports = free_ports(1 + 2 * len(instances))
    data.setdefault("router", {})["port"] = ports[0]
    for k, inst in enumerate(instances):
        inst["port"], inst["kv_port"] = ports[1 + 2 * k], ports[2 + 2 * k]
    path = folder / template.name
    path.write_text(yaml.safe_dump(data))
    return path


async def batch(client: httpx.AsyncClient, url: str, tokens: int, concurrency: int, extra: dict) -> float:
    """Seconds per generated token of ``concurrency`` requests sent together."""
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}
    start = time.perf_counter()
    replies = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    generated = 0
    for r in replies:
        r.raise_for_status()
        generated += r.json()["usage"]["completion_tokens"]
    return seconds / generated


async def measure(url: str, tokens: int, repeats: int, concurrency: int) -> dict[str, float]:
    per_token: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    async with httpx.AsyncClient(timeout=600) as client:
        await batch(client, url, tokens, concurrency, {})  # warm-up
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per_token[name].append(await batch(client, url, tokens, concurrency, VARIANTS[name]))
    return {name: statistics.median(v) for name, v in per_token.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: build the tiny test model)")
    ap.add_argument("--config", default=str(Path(__file__).parents[2] / "configs" / "tiny-1p1d.yaml"))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = args.model
        if model is None:
            from engine.make_model import TinySpec, make_tiny

            model = str(make_tiny(folder / "tiny", TinySpec(arch="qwen3")))
        cluster = launch(
            write_config(Path(args.config), model, folder), folder / "run", sorted(os.sched_getaffinity(0))
        )
        try:
            got = asyncio.run(measure(cluster.url, args.tokens, args.repeats, args.concurrency))
        finally:
            cluster.stop()
    base = got["plain"]
    result = {
        "config": Path(args.config).name,
        "tokens": args.tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "ms_per_token": {name: round(v * 1e3, 3) for name, v in got.items()},
        "ratio": {name: round(v / base, 3) for name, v in got.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
