"""A prefill engine pushes a prompt's KV layer by layer into a decode engine
in another process; decoding continues and the greedy tokens equal
transformers ``generate`` on the same model.

Block sizes differ both ways (16 -> 32, 64 -> 16), and an NHD prefill cache
writes into an HND decode cache (16 NHD -> 8 HND).
"""

from __future__ import annotations

import pytest

from tests.engine.oracle import hf_greedy
from tests.transfer.conftest import nixl_available
from tests.transfer.procs import Peer

pytestmark = pytest.mark.integration
PROMPT = [(11 * i) % 400 + 5 for i in range(45)]
MAX_TOKENS = 10
# (prefill name, block size, decode name, block size, decode cache order)
PAIRS = [("P16", 16, "D32", 32, "NHD"), ("P64", 64, "D16", 16, "NHD"), ("P16h", 16, "D8h", 8, "HND")]


@pytest.mark.parametrize(
    "backend",
    [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")), "zmq"],
)
def test_prefill_engine_pushes_into_decode_engine_and_tokens_match_transformers(tiny_model, backend):
    want = hf_greedy(tiny_model, PROMPT, MAX_TOKENS)
    started = [
        Peer(
            "engine-prefill",
            {
                "backend": backend,
                "model": tiny_model,
                "engines": [{"name": f"{p}-{backend}", "block_size": pb} for p, pb, _, _, _ in PAIRS],
            },
        ),
        Peer(
            "engine-decode",
            {
                "backend": backend,
                "model": tiny_model,
                "engines": [
                    {"name": f"{d}-{backend}", "block_size": db, "kv_layout": order} for _, _, d, db, order in PAIRS
                ],
            },
        ),
    ]
    prefill, decode = started
    try:
        for p, _, d, _, _ in PAIRS:
            p, d = f"{p}-{backend}", f"{d}-{backend}"
            answer = decode.ask(op="accept", engine=d, hello=prefill.first["hellos"][p])
            peer = prefill.ask(op="connect", engine=p, hello=answer["reply"])["peer"]
            res = decode.ask(op="reserve", engine=d, rid="r1", prompt=PROMPT, max_tokens=MAX_TOKENS, lease=30)
            done = prefill.ask(
                op="prefill",
                engine=p,
                rid="r1",
                prompt=PROMPT,
                tid=res["tid"],
                peer=peer,
                dst_blocks=res["blocks"],
                lease=30,
            )
            assert done["status"] == "completed", done
            assert done["blocks"]["free"] == 64  # released after the decode side accepted
            got = decode.ask(op="decode", engine=d, rid="r1", timeout=30)
            assert got.get("tokens") == want, (p, d, got)
            assert got["blocks"]["free"] == 64
    finally:
        for peer in started:
            peer.stop()
