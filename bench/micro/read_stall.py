"""What a prefill server's prefix read (POST /kv/read, decode-to-prefill reuse) costs the streams decoding on
the decode server it reads from: their inter-token latency while reads come, with the copy on the engine
thread (as before) against the read as it is now (blocks pinned on the engine thread, copied on a copy
thread of the service: ``GenerationService.read_prefix``), and with no reads at all.

    python -m bench.micro.read_stall [--model smollm2] [--tokens 1024] [--streams 4] [--threads 1]
                                     [--phase-s 5] [--rounds 3] [--gap-ms 50] [--json FILE]

One process holds a decode service (``GenerationService``, D's shape in the SmolLM2 clusters: blocks of 16,
HND, float32) over a real engine thread. Its receiver writes nothing: a reservation is told its KV arrived
with a first token, and ``--streams`` streams decode over whatever their blocks hold (only their timing
counts), each opened again when it ends. A conversation's first turn of ``--tokens`` tokens is prefilled
there, and the next turn's reservation then pins it and stays waiting; the reads are of those tokens, one
after another with ``--gap-ms`` between them. The variants take turns, ``--phase-s`` seconds each, for
``--rounds`` rounds, in one run:

- ``none``: no reads;
- ``engine``: the earlier read: the tokens copied on the engine thread between two steps (torch ``copy_``
  per block, as ``read_tokens`` did), then encoded and checksummed on a worker thread;
- ``pinned``: ``read_prefix`` as the server runs it now.

Per variant: the streams' inter-token latency (p50, p90, p99, max; a gap between two token writes of one
stream over the tokens the later one carries), tokens decoded per second, reads done and their time, and
``engine_held_ms``, the engine thread's time for one read (p50): the copy for ``engine``, the pin and the
unpin for ``pinned``. The
ratios are against ``none`` and ``engine`` over ``pinned``. The load averages are printed before and after.
A script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

VARIANTS = ("none", "engine", "pinned")


class _Receiver:
    """A decode server's KV receiver that receives nothing: each transfer ends when the benchmark says."""

    def __init__(self, notify) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._ended: list = []
        self._issued = 0

    def start(self) -> None:
        pass

    def accept(self, sender_hello: bytes, timeout_s: float) -> list[bytes]:
        raise ValueError("no prefill server here")

    def expect(self, block_ids: list[int], lease_s: float, writable_from: int = 0):
        from kvlink.ports import Expected
        from wire.kv_target import KVTarget

        self._issued += 1
        return Expected(f"t{self._issued}", KVTarget(peer="d0", epoch="bench"))

    def end(self, transfer_id: str, first_token: int | None) -> None:
        from transfer.outcome import Outcome, TransferEnded

        ok = first_token is not None
        outcome, tokens = (Outcome.OK, (first_token,)) if ok else (Outcome.CANCELLED, None)
        with self._lock:
            self._ended.append(TransferEnded(transfer_id, outcome, "", tokens))
        self._notify()

    def cancel(self, transfer_id: str) -> None:
        self.end(transfer_id, None)

    def take_finished(self) -> list:
        with self._lock:
            out, self._ended = self._ended, []
        return out

    def counters(self) -> dict[str, int]:
        return {}

    def open_transfers(self) -> int:
        return 0

    def problem(self, stuck_after_s: float) -> str | None:
        return None

    def close(self) -> None:
        pass


def _engine_thread_copy(cache, block_ids, start: int, end: int) -> torch.Tensor:
    """The copy a read made on the engine thread before: torch ``copy_`` per block (the engine's OpenMP team)."""
    bs = cache.block_size
    first, last = start // bs, -(-end // bs)
    blocks = cache.kv.transpose(3, 4) if cache.order == "HND" else cache.kv
    layers, _, _, _, heads, width = blocks.shape
    out = torch.empty((layers, 2, end - start, heads, width), dtype=cache.dtype)
    for i in range(first, last):
        a, b = max(start, i * bs), min(end, (i + 1) * bs)
        out[:, :, a - start : b - start].copy_(blocks[:, :, block_ids[i], a - i * bs : b - i * bs])
    return out


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _run(args) -> dict:
    from decode_server.service import GenerationService
    from engine import EngineConfig
    from engine.models import MODEL_CACHE, resolve_model
    from engine.request import SamplingParams
    from kvlink.prefix_read import encode_prefix
    from server_common.engine_thread import build_engine
    from server_common.settings import ServerSettings
    from wire.requests import GenerateRequest, KVPrefixRead

    model = str(resolve_model(args.model, MODEL_CACHE))
    config = EngineConfig(
        model=model,
        block_size=16,
        kv_layout="HND",
        num_blocks=args.blocks,
        num_threads=args.threads,
        mode="decode",
        max_model_len=args.tokens + 512,
    )
    engine = build_engine(config)
    receivers: list[_Receiver] = []

    def make_receiver(notify):
        receivers.append(_Receiver(notify))
        return receivers[0]

    service = GenerationService(
        ServerSettings(name="d0", role="decode", engine=config, lease_s=3600.0), engine, make_receiver
    )
    (receiver,) = receivers
    await service.start()
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    turn1 = [(31 * i + 7) % 20000 + 100 for i in range(args.tokens)]
    try:
        # The first turn prefilled here, its blocks cached; the next turn's reservation pins them and waits.
        first, active = await service.open(
            GenerateRequest(request_id="turn1", prompt_token_ids=turn1, sampling=greedy, local_prefill=True)
        )
        async for _ in service.events(first, active):
            pass
        first, _ = await service.open(
            GenerateRequest(request_id="turn2", prompt_token_ids=turn1 + list(range(500, 516)), sampling=greedy)
        )
        assert first.reservation is not None and first.num_cached_tokens == args.tokens, first.num_cached_tokens
        tid = first.reservation.transfer_id

        stamps: list[list[tuple[float, int]]] = [[] for _ in range(args.streams)]  # (time, tokens) per write
        stop = asyncio.Event()

        async def stream(k: int) -> None:
            n = 0
            sampling = SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
            while not stop.is_set():
                n += 1
                prompt = [(13 * i + 101 * k + n) % 20000 + 100 for i in range(32)]
                req = GenerateRequest(request_id=f"s{k}-{n}", prompt_token_ids=prompt, sampling=sampling)
                first, active = await service.open(req)
                assert first.reservation is not None
                receiver.end(first.reservation.transfer_id, 42)
                last = None
                async for chunk in service.events(first, active):
                    tokens = chunk.count('"token_ids"')
                    now = time.perf_counter()
                    if tokens and last is not None:
                        stamps[k].append((now, tokens))
                    if tokens:
                        last = now
                    if stop.is_set():
                        break
                await service.close(req.request_id)

        reads: dict[str, list[float]] = {v: [] for v in VARIANTS}
        # The engine thread's time for each read: the copy (engine), the pin and the unpin (pinned).
        held: dict[str, list[float]] = {v: [] for v in VARIANTS}

        def timed(fn, into: list[float]):
            def call(*a):
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    into.append(time.perf_counter() - t0)

            return call

        pins: list[float] = []
        engine.pin_reserved = timed(engine.pin_reserved, pins)  # type: ignore[method-assign]
        engine.unpin = timed(engine.unpin, pins)  # type: ignore[method-assign]

        async def read_once(variant: str) -> None:
            t0 = time.perf_counter()
            if variant == "pinned":
                await service.read_prefix(KVPrefixRead(transfer_id=tid, start=0, end=args.tokens))
            else:

                def copy(e) -> torch.Tensor:
                    return _engine_thread_copy(e.cache, e.scheduler.parked["turn2"].block_ids, 0, args.tokens)

                tokens = await service.engine_thread.run(timed(copy, held[variant]))
                await asyncio.to_thread(encode_prefix, tid, 0, args.tokens, tokens)
            reads[variant].append(time.perf_counter() - t0)
            if variant == "pinned":
                await service.engine_thread.run(lambda e: None)  # its unpin ran: it was queued before this
                held[variant].append(sum(pins))
                pins.clear()

        streams = [asyncio.create_task(stream(k)) for k in range(args.streams)]
        # Every stream decoding before the first phase.
        deadline = time.monotonic() + 60
        while not all(stamps) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        phases: list[tuple[str, float, float]] = []
        for _ in range(args.rounds):
            for variant in VARIANTS:
                start = time.perf_counter()
                end = start + args.phase_s
                while time.perf_counter() < end:
                    if variant == "none":
                        await asyncio.sleep(min(0.1, end - time.perf_counter()))
                    else:
                        await read_once(variant)
                        await asyncio.sleep(args.gap_ms / 1e3)
                phases.append((variant, start, time.perf_counter()))
        stop.set()
        await asyncio.gather(*streams)
        await service.close("turn2")
    finally:
        await service.stop()
        engine.close()

    out: dict[str, dict] = {}
    for variant in VARIANTS:
        windows = [(a, b) for v, a, b in phases if v == variant]
        gaps: list[float] = []
        decoded = 0
        for writes in stamps:
            prev = None
            for t, n in writes:
                inside = any(a <= t < b for a, b in windows)
                if inside and prev is not None and any(a <= prev < b for a, b in windows):
                    gaps += [(t - prev) / n] * n
                    decoded += n
                prev = t
        seconds = sum(b - a for a, b in windows)
        r = reads[variant]
        out[variant] = {
            "itl_p50_ms": 1e3 * _pct(gaps, 0.5),
            "itl_p90_ms": 1e3 * _pct(gaps, 0.9),
            "itl_p99_ms": 1e3 * _pct(gaps, 0.99),
            "itl_max_ms": 1e3 * max(gaps, default=0.0),
            "itl_mean_ms": 1e3 * (statistics.fmean(gaps) if gaps else 0.0),
            "tok_per_s": decoded / seconds if seconds else 0.0,
            "reads": len(r),
            "read_p50_ms": 1e3 * _pct(r, 0.5),
            "read_max_ms": 1e3 * max(r, default=0.0),
            "engine_held_ms": 1e3 * _pct(held[variant], 0.5),  # the engine thread's time for a read, p50
        }
    kv = engine.cache.kv
    out["read_mb"] = {"mb": kv[:, :, 0].numel() * kv.element_size() * args.tokens / 16 / 1e6}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of each read (a multiple of 16)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=256, help="tokens of each stream before it opens again")
    p.add_argument("--threads", type=int, default=1, help="the decode engine's torch threads")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--phase-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gap-ms", type=float, default=50.0, help="between one read's answer and the next read")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    assert args.tokens % 16 == 0, "whole blocks of 16"
    load_before = os.getloadavg()
    out = asyncio.run(_run(args))
    load_after = os.getloadavg()
    print(f"model {args.model}, reads of {args.tokens} tokens ({out['read_mb']['mb']:.1f} MB), {args.streams} streams,")
    print(f"{args.threads} engine thread(s), {args.rounds} rounds of {args.phase_s:.0f} s per variant, one run")
    cols = (
        "itl_p50_ms",
        "itl_p90_ms",
        "itl_p99_ms",
        "itl_max_ms",
        "itl_mean_ms",
        "tok_per_s",
        "reads",
        "read_p50_ms",
        "engine_held_ms",
    )
    print(f"{'variant':8} " + " ".join(f"{c:>12}" for c in cols))
    for v in VARIANTS:
        print(f"{v:8} " + " ".join(f"{out[v][c]:12.1f}" for c in cols))
    for c in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms", "itl_mean_ms"):
        e, pn, n = out["engine"][c], out["pinned"][c], out["none"][c]
        print(
            f"{c}: engine/pinned {e / pn if pn else 0:.2f}x, engine/none {e / n if n else 0:.2f}x, "
            f"pinned/none {pn / n if n else 0:.2f}x"
        )
    print(f"load average before {load_before}, after {load_after}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "results": out,
                    "load_before": load_before,
                    "load_after": load_after,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
