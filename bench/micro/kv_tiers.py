"""Loading a prefix's blocks from a KV tier against computing them again: where reading wins.

    python -m bench.micro.kv_tiers [--model smollm2] [--lengths 64,256,1024,2048] [--threads 1] \\
        [--rounds 3] [--redis-url redis://127.0.0.1:6379/0] [--json FILE]

One engine on ``--model`` (float32, block 16, prefix caching off so that every prompt is
computed), and, over its cache, one host-memory tier and one disk tier (a temporary
folder). For each prompt length L, with N = (L - 1) // 16 blocks (what a prefix hit of
the prompt would load, its last token always computed):

- ``recompute_ms``: the engine prefilling the L tokens and sampling one (median of the rounds);
- ``host_ms`` / ``disk_ms``: ``KvTiers.load`` of N blocks from that tier into the cache, every
  layer (a read, its CRC32 check, the copy), median of the rounds; the disk's files were just
  written, so the OS may serve them from its page cache;
- ``disk_cold_ms``: the same after each file was synced and dropped from the page cache
  (``posix_fadvise(DONTNEED)``), so the bytes come from the device;
- ``redis_ms`` (with ``--redis-url``): the same from the shared Redis store (one GET a block);
- ``*_ratio``: recompute_ms / that tier's ms (above 1: loading wins by that factor), and
  ``*_ms_per_block`` for the crossover: a tier pays per block, a prefill pays per token and,
  for long prompts, per token squared.

The table is printed from one run; ``--json`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_LENGTHS = "64,256,1024,2048"
BLOCK = 16


def _prefill_ms(engine, length: int, salt: int) -> float:
    from engine import SamplingParams

    prompt = [(31 * i + 7 * salt) % 500 + 3 for i in range(length)]
    engine.add_request(f"p{salt}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return 1000 * (time.perf_counter() - start)


def _drop_from_page_cache(paths: list[Path]) -> None:
    """Write each file back and drop its pages, so that the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load_ms(tiers, hashes: list[int], rounds: int, before=None) -> float:
    """Median ms of loading ``hashes`` into the cache's first blocks (``before()`` runs untimed first)."""
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        start = time.perf_counter()
        loaded = tiers.load(hashes, list(range(len(hashes))))
        times.append(1000 * (time.perf_counter() - start))
        assert loaded == len(hashes), (loaded, len(hashes))
    return statistics.median(times)


def _fill(tiers, num_blocks: int) -> list[int]:
    """Write cache blocks 0..num_blocks-1 to every tier under hashes 1..num_blocks; wait for the writes."""
    hashes = list(range(1, num_blocks + 1))
    for block_id, h in enumerate(hashes):
        tiers.evicted(block_id, h)
    assert tiers.drain(300)
    return hashes


def measure(model: str, lengths: list[int], threads: int, rounds: int, redis_url: str | None = None) -> list[dict]:
    from engine import EngineConfig, LLMEngine
    from engine.models import MODEL_CACHE, resolve_model
    from engine.tiers.disk import DiskTier
    from engine.tiers.host import HostTier
    from engine.tiers.kv import KvTiers

    torch.set_num_threads(threads)
    most = max(lengths)
    engine = LLMEngine(
        EngineConfig(
            model=str(resolve_model(model, MODEL_CACHE)),
            num_threads=threads,
            num_blocks=most // BLOCK + 2,
            block_size=BLOCK,
            max_num_batched_tokens=most,
            prefix_caching=False,
        )
    )
    _prefill_ms(engine, most, 0)  # warm up, and fill the blocks with real K/V
    rows, salt = [], 0
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as folder:
        room = 4 * (most // BLOCK + 2) * engine.cache.kv[:, :, 0].numel() * engine.cache.kv.element_size()
        host = KvTiers(engine.cache, [HostTier(room, queue_blocks=most)])
        disk_tier = DiskTier(Path(folder), room, queue_blocks=most)
        disk = KvTiers(engine.cache, [disk_tier])
        shared = None
        if redis_url is not None:
            from engine.tiers.redis_store import RedisTier

            shared = KvTiers(engine.cache, [RedisTier(redis_url, f"bench-{os.getpid()}", queue_blocks=most)])
        for length in lengths:
            n = (length - 1) // BLOCK
            recompute = []
            for _ in range(rounds):
                salt += 1
                recompute.append(_prefill_ms(engine, length, salt))
            host_hashes, disk_hashes = _fill(host, n), _fill(disk, n)
            files = [disk_tier.path(h) for h in disk_hashes]
            row = {
                "prompt_tokens": length,
                "blocks": n,
                "block_bytes": host.block_nbytes,
                "recompute_ms": statistics.median(recompute),
                "host_ms": _load_ms(host, host_hashes, rounds),
                "disk_ms": _load_ms(disk, disk_hashes, rounds),
                "disk_cold_ms": _load_ms(disk, disk_hashes, rounds, lambda files=files: _drop_from_page_cache(files)),
            }
            tiers = ["host", "disk", "disk_cold"]
            if shared is not None:
                row["redis_ms"] = _load_ms(shared, _fill(shared, n), rounds)
                tiers.append("redis")
            for tier in tiers:
                row[f"{tier}_ratio"] = row["recompute_ms"] / max(row[f"{tier}_ms"], 1e-6)
                row[f"{tier}_ms_per_block"] = row[f"{tier}_ms"] / max(n, 1)
            row["recompute_ms_per_block"] = row["recompute_ms"] / max(n, 1)
            rows.append(row)
        for tiers_open in (host, disk, shared):
            if tiers_open is not None:
                tiers_open.close()
    engine.close()
    return rows


def table(rows: list[dict]) -> str:
    """One line per length: the times, then recompute / load per tier (Redis's when measured)."""
    tiers = [("host", "host"), ("disk", "disk"), ("disk_cold", "cold")]
    if rows and "redis_ms" in rows[0]:
        tiers.append(("redis", "redis"))
    head = f"{'tokens':>7} {'blocks':>6} {'recompute ms':>12} " + " ".join(f"{label + ' ms':>8}" for _, label in tiers)
    lines = [head + " " + " ".join(f"{label + ' x':>7}" for _, label in tiers)]
    for r in rows:
        times = " ".join(f"{r[tier + '_ms']:>8.2f}" for tier, _ in tiers)
        ratios = " ".join(f"{r[tier + '_ratio']:>7.1f}" for tier, _ in tiers)
        lines.append(f"{r['prompt_tokens']:>7} {r['blocks']:>6} {r['recompute_ms']:>12.2f} {times} {ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.kv_tiers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="a built-in model name or a folder (default smollm2)")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"prompt lengths (default {DEFAULT_LENGTHS})")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", help="also time the shared Redis tier on this server (keys left there)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    if min(lengths) <= BLOCK:
        parser.error(f"every length must be above one block ({BLOCK} tokens)")
    rows = measure(args.model, lengths, args.threads, args.rounds, args.redis_url)
    print(f"{args.model}, float32, block {BLOCK}, {args.threads} thread(s); x = recompute ms / load ms")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
