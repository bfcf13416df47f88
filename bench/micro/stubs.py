"""Stub prefill and decode servers: pdserve's internal protocol, no model.

They answer the router exactly as the real servers do
(``wire/requests.py`` in, ``wire/replies.py``
out): a decode stub's ``/generate`` streams a reservation (null when asked
to prefill locally) and then ``max_tokens`` token events, the last with
``finish_reason: "length"``; a prefill stub's ``/prefill`` "writes the
KV" by telling the decode stub the reservation's ``kv_target`` names
(``POST /stub/kv_done`` at the address given with ``--decode-peer``, as a
real prefill server knows its decode peers' addresses; where the real
servers send a completion notice) and answers a ``PrefillResult``. As on the real decode server,
tokens of a request with a reservation follow only once its KV is in. Both answer ``/abort`` and ``/health``. What the
router costs is then everything that is not the stubs' (bench/micro/router_bench.py).

``GET /stub/stats`` counts what a test asserts on: requests, aborts, and the
TCP connections the stub has accepted (distinct client address and port), so
a router that reuses its connections shows a small, bounded number.

Run one: ``python -m bench.micro.stubs decode --port 8200 [--token-delay S]``.
The byte-level tokenizer folder that the router needs without a model is
``make_byte_tokenizer``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from wire.replies import (
    HealthReport,
    KVBlocks,
    PrefillResult,
    Reservation,
    ReservationEvent,
    TokensEvent,
)
from wire.requests import AbortRequest, GenerateRequest, PrefillRequest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
KV_WAIT_S = 30.0  # a decode stub's lease: the longest a reservation waits for its KV
STUB_TOKENS = tuple(range(66, 92))  # byte-level ids of plain letters; any id a tokenizer knows works


def make_byte_tokenizer(folder: Path, max_position_embeddings: int = 256) -> Path:
    """A model folder with only a tokenizer: one token per UTF-8 byte, plus <|eos|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    vocab["<|eos|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": max_position_embeddings})
    )
    return folder


class StubStats:
    def __init__(self) -> None:
        self.clients: set[tuple[str, int]] = set()
        self.requests = 0
        self.aborts = 0
        self.open_streams = 0
        self.prefilling = 0

    @property
    def busy(self) -> bool:
        return self.open_streams > 0 or self.prefilling > 0

    def saw(self, request: Request) -> None:
        if request.client is not None:
            self.clients.add((request.client.host, request.client.port))

    def as_dict(self) -> dict:
        return {
            "connections": len(self.clients),
            "requests": self.requests,
            "aborts": self.aborts,
            "open_streams": self.open_streams,
        }


def _token_lines(n: int) -> list[bytes]:
    events = [TokensEvent(token_ids=[STUB_TOKENS[i % len(STUB_TOKENS)]]) for i in range(n)]
    events[-1] = TokensEvent(token_ids=events[-1].token_ids, finish_reason="length")
    return [e.model_dump_json().encode() + b"\n" for e in events]


def create_app(
    role: str,
    name: str,
    token_delay: float = 0.0,
    health_delay: float = 0.0,
    decode_peers: dict[str, str] | None = None,
) -> Starlette:
    """A stub server of ``role`` ("decode" or "prefill"); ``token_delay`` s before each token event,
    ``health_delay`` s before each health answer while it serves a request (a server too busy to
    answer health checks; idle, it answers at once). ``decode_peers``: a prefill stub's decode
    stubs, name -> URL."""
    peers = dict(decode_peers or {})
    stats = StubStats()
    lines_by_count: dict[int, list[bytes]] = {}
    kv_arrived: dict[str, asyncio.Event] = {}  # decode: transfer id -> set by /stub/kv_done
    notify: list[httpx.AsyncClient] = []  # prefill: one keep-alive client for the notices, made on first use

    async def stream(first: bytes, lines: list[bytes], transfer_id: str | None):
        stats.open_streams += 1
        try:
            yield first
            if transfer_id is not None:
                try:
                    await asyncio.wait_for(kv_arrived[transfer_id].wait(), KV_WAIT_S)
                finally:
                    kv_arrived.pop(transfer_id, None)
            for line in lines:
                if token_delay:
                    await asyncio.sleep(token_delay)
                yield line
        finally:
            stats.open_streams -= 1

    async def generate(request: Request) -> Response:
        stats.saw(request)
        stats.requests += 1
        req = GenerateRequest.model_validate_json(await request.body())
        reservation = None
        if not req.local_prefill:
            transfer_id = f"t-{req.request_id}"
            kv_arrived[transfer_id] = asyncio.Event()
            reservation = Reservation(
                instance=name,
                request_id=req.request_id,
                transfer_id=transfer_id,
                block_ids=list(range(len(req.prompt_token_ids) // 16 + 1)),
                block_size=16,
                num_tokens=len(req.prompt_token_ids),
                lease_s=KV_WAIT_S,
                kv_target={"peer": name},
            )
        n = req.sampling.max_tokens
        if n not in lines_by_count:
            lines_by_count[n] = _token_lines(n)
        first = ReservationEvent(reservation=reservation).model_dump_json().encode() + b"\n"
        return StreamingResponse(
            stream(first, lines_by_count[n], reservation and reservation.transfer_id), media_type="application/x-ndjson"
        )

    async def kv_done(request: Request) -> Response:
        event = kv_arrived.get((await request.json())["transfer_id"])
        if event is not None:
            event.set()
        return JSONResponse({"accepted": event is not None})

    async def prefill(request: Request) -> Response:
        stats.saw(request)
        stats.requests += 1
        req = PrefillRequest.model_validate_json(await request.body())
        if not notify:
            notify.append(httpx.AsyncClient(timeout=10.0))
        stats.prefilling += 1
        try:
            url = peers[req.reservation.kv_target.peer]
            await notify[0].post(f"{url}/stub/kv_done", json={"transfer_id": req.reservation.transfer_id})
        finally:
            stats.prefilling -= 1
        result = PrefillResult(
            request_id=req.request_id,
            first_token_ids=[STUB_TOKENS[0]],
            num_tokens=len(req.prompt_token_ids),
            transfer_bytes=0,
            seconds=0.0,
        )
        return Response(result.model_dump_json(), media_type="application/json")

    async def abort(request: Request) -> Response:
        stats.saw(request)
        stats.aborts += 1
        req = AbortRequest.model_validate_json(await request.body())
        return JSONResponse({"request_id": req.request_id, "aborted": True})

    async def health(request: Request) -> Response:
        if health_delay and stats.busy:
            await asyncio.sleep(health_delay)
        report = HealthReport(
            role=role,
            instance=name,
            kv_blocks=KVBlocks(free=1000, reserved=0, running=0, total=1000),
            queue_depth=0,
            queued_tokens=0,
            num_requests=stats.open_streams,
        )
        return Response(report.model_dump_json(), media_type="application/json")

    async def stub_stats(request: Request) -> Response:
        return JSONResponse(stats.as_dict())

    work = (
        [Route("/generate", generate, methods=["POST"]), Route("/stub/kv_done", kv_done, methods=["POST"])]
        if role == "decode"
        else [Route("/prefill", prefill, methods=["POST"])]
    )
    return Starlette(
        routes=[
            *work,
            Route("/abort", abort, methods=["POST"]),
            Route("/health", health),
            Route("/stub/stats", stub_stats),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m bench.micro.stubs", description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["decode", "prefill"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--name", default=None, help="instance name (default: the role)")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds before each token event")
    p.add_argument(
        "--health-delay", type=float, default=0.0, help="seconds before each /health answer while serving a request"
    )
    p.add_argument(
        "--keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle connection stays open (uvicorn's default, as on the real servers)",
    )
    p.add_argument(
        "--decode-peer",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a prefill stub's decode stub (repeat for several)",
    )
    args = p.parse_args(argv)
    peers = dict(peer.split("=", 1) for peer in args.decode_peer)
    app = create_app(args.role, args.name or args.role, args.token_delay, args.health_delay, peers)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, timeout_keep_alive=args.keep_alive
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
