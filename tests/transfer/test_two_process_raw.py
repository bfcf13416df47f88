"""Two real processes on 127.0.0.1 moving raw caches (random bytes).

One sender and one receiver process per backend serve the whole module; a
test that kills one gets a fresh process with the same name next time, which
also proves that a restarted peer is re-handshaken.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from tests.transfer.conftest import nixl_available
from tests.transfer.oracle import expected_after_copy
from tests.transfer.procs import Peer
from transfer.layout import KVLayout

pytestmark = pytest.mark.integration
BACKENDS = [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")), "zmq"]
SRC = KVLayout.for_engine_cache(
    num_layers=4, num_blocks=24, block_size=16, num_kv_heads=4, head_dim=32, dtype="bfloat16"
)
DST = SRC.replace(block_size=32, num_blocks=20, order="HND")
SRC_BLOCKS, DST_BLOCKS, TOKENS = [5, 6, 7, 1, 20, 21], [11, 3, 4], 90
SEED = 1234


def as_cfg(layout: KVLayout) -> dict:
    return json.loads(msgspec.json.encode(layout))


GRACE = 0.3


@pytest.fixture(scope="module")
def pair():
    """``pair(backend) -> (sender, receiver, receiver name)``, both alive and met."""
    live: dict[str, dict] = {}
    started: list[Peer] = []

    def get(backend: str):
        state = live.setdefault(backend, {})
        fresh = False
        if state.get("recv") is None or state["recv"].proc.poll() is not None:
            state["recv"] = Peer(
                "raw-recv", {"backend": backend, "name": f"D-{backend}", "layout": as_cfg(DST), "grace": GRACE}
            )
            started.append(state["recv"])
            fresh = True
        if state.get("send") is None or state["send"].proc.poll() is not None:
            state["send"] = Peer(
                "raw-send",
                {"backend": backend, "name": f"P-{backend}", "layout": as_cfg(SRC), "seed": SEED, "checksum": "all"},
            )
            started.append(state["send"])
            fresh = True
        if fresh:
            answer = state["recv"].ask(op="accept", hello=state["send"].first["hello"])
            state["peer"] = state["send"].ask(op="connect", hello=answer["reply"])["peer"]
        return state["send"], state["recv"], state["peer"]

    yield get
    for peer in started:
        peer.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_converted_transfer_is_byte_exact_between_processes(pair, backend, tmp_path):
    send, recv, peer = pair(backend)
    tid = recv.ask(op="expect", blocks=DST_BLOCKS, lease=20)["tid"]
    send.ask(
        op="send",
        tid=tid,
        peer=peer,
        src_blocks=SRC_BLOCKS,
        dst_blocks=DST_BLOCKS,
        start=0,
        end=TOKENS,
        first_tokens=(7,),
        lease=20,
    )
    got = recv.ask(op="wait", timeout=20)
    assert got["completed"] == [[tid, [7]]], got
    assert send.ask(op="wait", timeout=10)["completed"] == [[tid, None]]
    dumped = recv.ask(op="dump", path=str(tmp_path / "dst.bin"))
    assert dumped["counters"]["completed"] == 1
    src = np.random.default_rng(SEED).integers(0, 256, SRC.total_bytes, dtype=np.uint8)
    expected = expected_after_copy(
        src, SRC, SRC_BLOCKS, 0, TOKENS, np.zeros(DST.total_bytes, np.uint8), DST, DST_BLOCKS
    )
    np.testing.assert_array_equal(np.fromfile(tmp_path / "dst.bin", dtype=np.uint8), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_sender_fails_the_transfer_within_lease_plus_grace(pair, backend):
    send, recv, peer = pair(backend)
    tid = recv.ask(op="expect", blocks=DST_BLOCKS, lease=1.0)["tid"]
    send.ask(
        op="send",
        tid=tid,
        peer=peer,
        src_blocks=SRC_BLOCKS,
        dst_blocks=DST_BLOCKS,
        start=0,
        end=TOKENS,
        first_tokens=(7,),
        lease=20,
        layers=1,
        finish=False,
    )
    send.kill()
    got = recv.ask(op="wait", timeout=8)
    assert [f[0] for f in got["failed"]] == [tid], got
    assert got["elapsed"] < 1.0 + GRACE + 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_receiver_makes_the_sender_fail_not_hang(pair, backend):
    send, recv, peer = pair(backend)
    tid = recv.ask(op="expect", blocks=DST_BLOCKS, lease=60)["tid"]
    recv.kill()
    send.ask(
        op="send",
        tid=tid,
        peer=peer,
        src_blocks=SRC_BLOCKS,
        dst_blocks=DST_BLOCKS,
        start=0,
        end=TOKENS,
        first_tokens=(7,),
        lease=60,
    )
    got = send.ask(op="wait", timeout=15)
    assert [f[0] for f in got["failed"]] == [tid], got
    assert "lease" not in got["failed"][0][1]
    assert got["elapsed"] < 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_sender_meets_a_restarted_receiver_of_the_same_name_afresh(pair, backend, tmp_path):
    _, old, _ = pair(backend)
    old.kill()
    send, recv, peer = pair(backend)  # a new receiver process, same name, fresh hello
    assert recv.pid != old.pid
    tid = recv.ask(op="expect", blocks=DST_BLOCKS, lease=20)["tid"]
    send.ask(
        op="send",
        tid=tid,
        peer=peer,
        src_blocks=SRC_BLOCKS,
        dst_blocks=DST_BLOCKS,
        start=0,
        end=TOKENS,
        first_tokens=(3,),
        lease=20,
    )
    assert recv.ask(op="wait", timeout=20)["completed"] == [[tid, [3]]]
