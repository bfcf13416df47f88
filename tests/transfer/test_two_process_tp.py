"""A TP 2 prefill group and a TP 4 decode group (2 KV heads: replicated on the
decode side), each in its own process on 127.0.0.1, every rank with its own
cache and backend agent, over NIXL and ZeroMQ: each prefill rank writes its
head straight into both decode ranks holding it; a transfer completes only
when every part arrived, and one rank's failure on either side ends every
part with that rank's code, leaving no reservation or transfer open."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from engine.tensor_parallel import kv_heads_for_rank
from tests.transfer.conftest import nixl_available
from tests.transfer.oracle import expected_after_copy
from transfer.layout import KVLayout
from transfer.outcome import Outcome
from transfer.tp import route_heads

pytestmark = pytest.mark.integration
BACKENDS = [pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed")), "zmq"]
SEED, FIRST = 99, [11, 12]
SRC_BLOCKS, DST_BLOCKS, TOKENS = [3, 0, 5, 1, 9], [4, 10, 2, 7, 12, 0, 8, 1, 6, 3], 75


def group(tp: int, **cache) -> list[KVLayout]:
    return [
        KVLayout(
            num_layers=3,
            num_kv_heads_total=2,
            head_ids=kv_heads_for_rank(2, r, tp),
            head_dim=32,
            dtype="bfloat16",
            tp_rank=r,
            tp_size=tp,
            **cache,
        )
        for r in range(tp)
    ]


SRC = group(2, block_size=16, num_blocks=12)
DST = group(4, block_size=8, num_blocks=14, order="HND")


def as_cfg(layouts: list[KVLayout]) -> list[dict]:
    return [json.loads(msgspec.json.encode(layout)) for layout in layouts]


def expected_caches(start: int, end: int) -> list[np.ndarray]:
    src = [np.random.default_rng(SEED + r).integers(0, 256, s.total_bytes, dtype=np.uint8) for r, s in enumerate(SRC)]
    out = [np.zeros(d.total_bytes, dtype=np.uint8) for d in DST]
    for route in route_heads(SRC, DST):
        s, d = route.src_rank, route.dst_rank
        out[d] = expected_after_copy(src[s], SRC[s], SRC_BLOCKS, start, end, out[d], DST[d], DST_BLOCKS)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_prefill_fills_tp4_decode_and_one_rank_failure_fails_every_part(peers, backend, tmp_path):
    recv = peers("tp-recv", {"backend": backend, "name": f"D-{backend}", "layouts": as_cfg(DST), "grace": 0.3})
    send = peers("tp-send", {"backend": backend, "name": f"P-{backend}", "layouts": as_cfg(SRC), "seed": SEED})
    for p, hello in enumerate(send.first["hellos"]):  # the handshake, once per (P rank, D rank) pair
        for d in range(len(DST)):
            answer = recv.ask(op="accept", rank=d, hello=hello)["reply"]
            assert send.ask(op="connect", rank=p, hello=answer)["peer"] == f"D-{backend}-r{d}"

    def transfer(lease: float, **send_opts) -> tuple[str, dict]:
        res = recv.ask(op="expect", blocks=DST_BLOCKS, lease=lease, writable_from=1)
        send.ask(
            op="send",
            gid=res["gid"],
            target=res["target"],
            src_blocks=SRC_BLOCKS,
            dst_blocks=DST_BLOCKS,
            lease=lease,
            chunks=[[8, 40], [40, TOKENS]],  # tokens 0-7: the decode side's cached prefix
            first_tokens=FIRST,
            **send_opts,
        )
        return res["gid"], res["target"]

    # every rank's part arrives: byte-exact on all four decode ranks
    gid, target = transfer(lease=20)
    assert [p["transfer_id"] for p in target["ranks"]][0] == gid
    assert recv.ask(op="wait", timeout=20)["ended"] == [[gid, "ok", "", FIRST]]
    assert send.ask(op="wait", timeout=10)["ended"] == [[gid, "ok", "", None]]
    dumped = recv.ask(op="dump", path=str(tmp_path / "dst"))
    for d, want in enumerate(expected_caches(8, TOKENS)):
        np.testing.assert_array_equal(np.fromfile(tmp_path / f"dst.{d}", dtype=np.uint8), want)
    assert [c["completed"] for c in dumped["counters"]] == [1, 1, 1, 1]

    # decode rank 3 fails on its own: every part ends, both groups fail with its code
    res = recv.ask(op="expect", blocks=DST_BLOCKS, lease=20)
    recv.ask(op="cancel_part", rank=3, tid=res["target"]["ranks"][3]["transfer_id"], reason="rank 3 is gone")
    send.ask(
        op="send",
        gid=res["gid"],
        target=res["target"],
        src_blocks=SRC_BLOCKS,
        dst_blocks=DST_BLOCKS,
        lease=20,
        chunks=[[0, TOKENS]],
        first_tokens=FIRST,
    )
    assert recv.ask(op="wait", timeout=10)["ended"] == [[res["gid"], "cancelled", "rank 3: rank 3 is gone", None]]
    [[gid, outcome, reason, _]] = send.ask(op="wait", timeout=10)["ended"]
    # the P ranks hear a Cancel (D's leader cancels the other parts too), or the refusal of a Done sent before it
    assert (gid, outcome in (Outcome.CANCELLED, Outcome.REFUSED), reason[:5]) == (res["gid"], True, "rank ")

    # prefill rank 1 fails on its own: its group fails at once, the decode group at the lease
    gid, _ = transfer(lease=1.0, fail_rank=1)
    assert send.ask(op="wait", timeout=10)["ended"] == [[gid, "aborted", "rank 1: aborted", None]]
    [[ended_gid, outcome, reason, _]] = recv.ask(op="wait", timeout=10)["ended"]
    assert (ended_gid, outcome) == (gid, "lease_expired")
    assert reason.endswith(": lease expired before the KV arrived")

    # nothing left open on any rank of either side
    dumped_d = recv.ask(op="dump", path=str(tmp_path / "after"))
    dumped_p = send.ask(op="dump", path=str(tmp_path / "after-p"))
    assert [(c["issued"], c["completed"] + c["failed"]) for c in dumped_d["counters"]] == [(3, 3)] * 4
    # D rank 3 failed twice; rank 2 (head 1, from P rank 1) at least at the lease
    assert dumped_d["counters"][3]["failed"] == 2 and dumped_d["counters"][2]["failed"] >= 1
    assert dumped_d["open_groups"] == dumped_p["open_groups"] == 0
    assert dumped_p["open_parts"] == [0, 0]
