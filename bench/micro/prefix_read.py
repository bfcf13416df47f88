"""Where a decode-to-prefill prefix read's time goes (kvlink/prefix_read.py), stage by stage.

    python -m bench.micro.prefix_read [--model smollm2] [--lengths 100,1000,4000] [--rounds 5] [--json FILE]

For each length L (tokens of the prefix read), on caches of ``--model``'s shape (float32; D's blocks of 16
HND, P's blocks of 16 NHD, as the SmolLM2 clusters use), the median over ``--rounds`` of:

- ``d_copy_ms``: ``read_tokens`` on one of D's copy threads (the pinned blocks picked out of its cache, contiguous);
- ``d_encode_ms``: ``encode_prefix`` (the answer's headers and the tensor's memory as its body, CRC32);
- ``fetch_ms``: ``fetch_prefix`` (P's read, on a worker thread) against POST /kv/read of a Starlette app in
  another process served by uvicorn, answering the same precomputed headers and body with the decode
  server's media type: the request, the body read into one buffer, the header checks, CRC32 (loopback,
  uvicorn's event loop);
- ``httpx_ms``: the same request through one kept-alive ``httpx.AsyncClient`` to ``resp.content`` (what
  P's client was before ``fetch_prefix``: 64 KiB reads through the event loop), for comparison only;
- ``p_decode_ms``: ``decode_prefix`` alone (CRC32, the tensor over the buffer; inside ``fetch_ms``);
- ``p_offer_ms``: ``cut_blocks`` on P's cache (what ``offer_prefix`` cuts on P's engine thread);
- ``p_load_ms``: ``OfferedBlocks.load`` of those blocks into P's cache (at the request's admission).

``total_ms``: d_copy + d_encode + fetch + p_offer + p_load (a read end to end, less the event loops'
and engine threads' waits of a busy server), ``mb``: the K/V bytes read. The table is printed from
one run; ``--json`` writes it too. The machine's load averages are printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

D_BLOCK, P_BLOCK = 16, 16
STAGES = ("d_copy_ms", "d_encode_ms", "fetch_ms", "httpx_ms", "p_decode_ms", "p_offer_ms", "p_load_ms")
IN_TOTAL = ("d_copy_ms", "d_encode_ms", "fetch_ms", "p_offer_ms", "p_load_ms")


def _cache(config: dict[str, Any], tokens: int, block: int, order: str):
    from engine.kv_cache import KVCache

    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    width = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    blocks = -(-tokens // block) + 2
    cache = KVCache(config["num_hidden_layers"], blocks, block, heads, width, torch.float32, torch.device("cpu"), order)
    cache.kv.normal_()
    return cache


def _serve(port: int, answers: dict[int, tuple[dict[str, str], bytes]]) -> None:
    """The answering process: POST /kv/read {"end": L} returns answers[L] (headers, body) as D does."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from kvlink.prefix_read import CONTENT_TYPE

    async def kv_read(request: Request) -> Response:
        body = await request.json()
        headers, data = answers[int(body["end"])]
        return Response(memoryview(data), media_type=CONTENT_TYPE, headers=headers)

    app = Starlette(routes=[Route("/kv/read", kv_read, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def _fetch_ms(url: str, length: int, rounds: int) -> float:
    from kvlink.prefix_read import fetch_prefix

    return _median_ms(lambda: fetch_prefix(url, {}, "t", 0, length, 60.0), rounds)


async def _httpx_ms(url: str, lengths: list[int], rounds: int, sizes: dict[int, int]) -> dict[int, float]:
    """Per length: the median ms of a POST read through httpx to ``resp.content``."""
    import httpx

    out: dict[int, float] = {}
    async with httpx.AsyncClient() as client:
        for length in lengths:
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                resp = await client.post(f"{url}/kv/read", json={"end": length}, timeout=60)
                assert len(resp.content) == sizes[length], (resp.status_code, resp.content[:200])
                times.append(1000 * (time.perf_counter() - start))
            out[length] = statistics.median(times)
    return out


def _wait_serving(url: str, length: int) -> None:
    from kvlink.prefix_read import PrefixReadError, fetch_prefix

    for _ in range(100):  # the server process is starting
        try:
            fetch_prefix(url, {}, "t", 0, length, 5.0)
            return
        except PrefixReadError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing answers at {url}")


def _stages(config: dict[str, Any], length: int, rounds: int) -> tuple[dict[str, float], tuple[dict[str, str], bytes]]:
    """One length's stages but the HTTP ones, and the answer D would send for it (headers, body)."""
    from engine.tiers.offered import OfferedBlocks, cut_blocks, read_tokens
    from kvlink.prefix_read import check_header, decode_prefix, encode_prefix

    d = _cache(config, length, D_BLOCK, "HND")
    p = _cache(config, length, P_BLOCK, "NHD")
    d_ids = list(range(d.num_blocks - 1, -1, -1))  # not in order, as a cache's blocks are
    tokens = read_tokens(d, d_ids, 0, length)
    headers, body = encode_prefix("t", 0, length, tokens)
    meta = check_header(headers, len(body), "t", 0, length)
    received = bytearray(body)
    whole = length // P_BLOCK * P_BLOCK
    hashes = list(range(whole // P_BLOCK))
    offered = OfferedBlocks(p, None)

    def load() -> None:
        offered.offer("r", hashes, cut_blocks(p, tokens[:, :, :whole]))
        offered.load(hashes, list(range(len(hashes))))
        offered.withdraw("r")

    row = {
        "tokens": length,
        "mb": len(body) / 1e6,
        "d_copy_ms": _median_ms(lambda: read_tokens(d, d_ids, 0, length), rounds),
        "d_encode_ms": _median_ms(lambda: encode_prefix("t", 0, length, tokens), rounds),
        "p_decode_ms": _median_ms(lambda: decode_prefix(meta, received), rounds),
        "p_offer_ms": _median_ms(lambda: cut_blocks(p, tokens[:, :, :whole]), rounds),
        "p_load_ms": _median_ms(load, rounds),
    }
    return row, (headers, bytes(body))


def measure(model: str, lengths: list[int], rounds: int) -> list[dict[str, float]]:
    from engine.models import MODEL_CACHE, resolve_model

    with open(os.path.join(resolve_model(model, MODEL_CACHE), "config.json")) as f:
        config = json.load(f)
    rows: list[dict[str, float]] = []
    answers: dict[int, tuple[dict[str, str], bytes]] = {}
    for length in lengths:
        row, answers[length] = _stages(config, length, rounds)
        rows.append(row)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = mp.get_context("spawn").Process(target=_serve, args=(port, answers), daemon=True)
    server.start()
    try:
        _wait_serving(url, lengths[0])
        fetched = {length: _fetch_ms(url, length, rounds) for length in lengths}
        sizes = {length: len(answers[length][1]) for length in lengths}
        through_httpx = asyncio.run(_httpx_ms(url, lengths, rounds, sizes))
    finally:
        server.terminate()
        server.join(10)
    for row in rows:
        row["fetch_ms"], row["httpx_ms"] = fetched[int(row["tokens"])], through_httpx[int(row["tokens"])]
        row["p_load_ms"] -= row["p_offer_ms"]  # load() cut the blocks too
        row["total_ms"] = sum(row[k] for k in IN_TOTAL)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="100,1000,4000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    rows = measure(args.model, [int(x) for x in args.lengths.split(",")], args.rounds)
    print(f"load average after: {os.getloadavg()}")
    keys = ["tokens", "mb", *STAGES, "total_ms"]
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.1f}" if k != "tokens" else str(row[k]) for k in keys))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
