"""TP routes move every head of every token into the right decode rank, block
and slot, and nothing else: a byte-level oracle over random TP pairs."""

import argparse
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bench.micro import transfer as bench
from engine.tensor_parallel import kv_heads_for_rank
from tests.transfer.oracle import logical
from transfer.inproc import InprocBackend, InprocHub
from transfer.layout import IncompatiblePeer, KVLayout
from transfer.messages import DecodeGroup, DecodeRank, group_to_builtins, parse_group
from transfer.plan import make_plan, ranges_inside
from transfer.tp import Route, rank_parts, route_heads
from wire.kv_target import KVTarget
from wire.replies import Reservation

SIZES = (1, 2, 4, 8)
BENCH_ARGS = argparse.Namespace(
    layers=3, blocks=4, block_size=16, kv_heads=2, head_dim=16, dtype="bfloat16", kv_order="NHD"
)


def group(total: int, tp: int, **kw) -> list[KVLayout]:
    return [
        KVLayout(num_kv_heads_total=total, head_ids=kv_heads_for_rank(total, r, tp), tp_rank=r, tp_size=tp, **kw)
        for r in range(tp)
    ]


@st.composite
def tp_pairs(draw):
    total = draw(st.sampled_from((1, 2, 4, 8)))
    model = dict(num_layers=draw(st.integers(1, 2)), head_dim=draw(st.sampled_from((1, 2, 4))))
    dtype = draw(st.sampled_from(("float32", "bfloat16", "float8_e4m3fn")))
    end = draw(st.integers(0, 70))
    start = draw(st.integers(0, end))
    sides = []
    for _ in range(2):
        tp = draw(st.sampled_from([s for s in SIZES if s % total == 0 or total % s == 0]))
        bs = draw(st.sampled_from((1, 2, 3, 4, 8, 16, 32)))
        need = -(-end // bs)
        num_blocks = need + draw(st.integers(1, 3))
        ids = draw(st.permutations(range(num_blocks)))[:need]
        cache = dict(
            block_size=bs,
            num_blocks=num_blocks,
            dtype=dtype,
            order=draw(st.sampled_from(("NHD", "HND"))),
            kv_fused=draw(st.booleans()),
        )
        sides.append((group(total, tp, **model, **cache), ids))
    return sides[0], sides[1], start, end


def place(truth: np.ndarray, layout: KVLayout, block_ids, buf: np.ndarray) -> None:
    """Write token ``p``'s vectors of ``truth`` ([L, kv, token, global head, bytes]) into a cache."""
    view = logical(buf, layout)
    for p in range(truth.shape[2]):
        view[:, :, block_ids[p // layout.block_size], p % layout.block_size] = truth[:, :, p, list(layout.head_ids)]


@settings(max_examples=120, deadline=None)
@given(tp_pairs(), st.integers(0, 2**32 - 1))
def test_every_head_of_every_token_lands_in_the_right_rank_block_and_slot(pair, seed):
    (src, src_ids), (dst, dst_ids), start, end = pair
    rng = np.random.default_rng(seed)
    one = src[0]
    truth = rng.integers(0, 256, (one.num_layers, 2, end, one.num_kv_heads_total, one.vec_bytes), dtype=np.uint8)
    src_bufs = [rng.integers(0, 256, s.total_bytes, dtype=np.uint8) for s in src]
    for layout, buf in zip(src, src_bufs):
        place(truth, layout, src_ids, buf)  # P holds every token, the ones before ``start`` too
    before = [rng.integers(0, 256, d.total_bytes, dtype=np.uint8) for d in dst]
    dst_bufs = [b.copy() for b in before]

    hub = InprocHub()
    senders = [InprocBackend(f"P{r}", hub) for r in range(len(src))]
    receivers = [InprocBackend(f"D{r}", hub) for r in range(len(dst))]
    for backend, buf in zip(senders + receivers, src_bufs + dst_bufs):
        backend.register("kv", torch.from_numpy(buf))
    routes = route_heads(src, dst)
    for route in routes:
        sender, receiver = senders[route.src_rank], receivers[route.dst_rank]
        sender.connect(receiver.name, receiver.metadata())
        plan = make_plan(src[route.src_rank], src_ids, start, end, dst[route.dst_rank], dst_ids, route.heads)
        for layer in range(one.num_layers):
            sender.write(receiver.name, "t", layer, "kv", *plan.layer(layer))
    for d, receiver in enumerate(receivers):
        for write in receiver.poll():
            assert ranges_inside(dst[d], dst_ids, write.dst_offsets, write.lengths)
            receiver.apply(write)

    for d, layout in enumerate(dst):  # every head exactly once, from a rank that holds it
        got = sorted(h for r in routes if r.dst_rank == d for h in r.heads)
        assert got == sorted(layout.head_ids)
        assert all(set(r.heads) <= set(src[r.src_rank].head_ids) for r in routes)
        want = before[d].copy()
        place(truth[:, :, :end], layout, dst_ids, want)
        keep = logical(before[d], layout)
        view = logical(want, layout)
        for p in range(start):  # tokens before ``start`` are D's cached prefix: untouched
            b, s = dst_ids[p // layout.block_size], p % layout.block_size
            view[:, :, b, s] = keep[:, :, b, s]
        np.testing.assert_array_equal(dst_bufs[d], want)


def model(total, tp, **kw):
    return group(total, tp, num_layers=1, head_dim=4, block_size=16, num_blocks=4, **kw)


@pytest.mark.parametrize(
    "total,p_tp,d_tp,routes",
    [
        (4, 2, 1, [Route(0, 0, (0, 1)), Route(1, 0, (2, 3))]),
        (4, 1, 2, [Route(0, 0, (0, 1)), Route(0, 1, (2, 3))]),
        (4, 2, 2, [Route(0, 0, (0, 1)), Route(1, 1, (2, 3))]),
        (4, 2, 4, [Route(0, 0, (0,)), Route(0, 1, (1,)), Route(1, 2, (2,)), Route(1, 3, (3,))]),
        (2, 2, 4, [Route(0, 0, (0,)), Route(0, 1, (0,)), Route(1, 2, (1,)), Route(1, 3, (1,))]),
        (2, 4, 2, [Route(0, 0, (0,)), Route(2, 1, (1,))]),  # P replicated: one holder sends each head
        (2, 4, 4, [Route(0, 0, (0,)), Route(1, 1, (0,)), Route(2, 2, (1,)), Route(3, 3, (1,))]),
        (2, 8, 1, [Route(0, 0, (0,)), Route(4, 0, (1,))]),
    ],
)
def test_routes_of_the_tp_pairs(total, p_tp, d_tp, routes):
    assert list(route_heads(model(total, p_tp), model(total, d_tp))) == routes


def test_different_block_sizes_and_orders_do_not_change_the_routes():
    assert route_heads(model(4, 2), group(4, 2, num_layers=1, head_dim=4, block_size=8, num_blocks=9, order="HND")) == (
        Route(0, 0, (0, 1)),
        Route(1, 1, (2, 3)),
    )


@pytest.mark.parametrize(
    "src,dst,message",
    [
        (model(4, 2), model(8, 2), "num_kv_heads_total: prefill has 4, decode has 8"),
        (model(4, 2), group(4, 2, num_layers=2, head_dim=4, block_size=16, num_blocks=4), "num_layers: prefill has 1"),
        (model(4, 2)[:1], model(4, 1), "prefill: rank 0 of 1 says it is rank 0 of tp_size 2"),
        (model(4, 2)[::-1], model(4, 1), "prefill: rank 0 of 2 says it is rank 1"),
        (model(4, 2), [model(4, 2)[0], model(4, 2)[1].replace(block_size=8)], "decode: rank 1's cache differs"),
        (model(4, 2), [model(4, 2)[0], model(4, 2)[1].replace(head_ids=(1,))], "decode: KV heads [2, 3] are held"),
        (model(4, 2), [], "decode: a TP group has 1 to 64 ranks, got 0"),
    ],
)
def test_incompatible_groups_are_refused_naming_the_values(src, dst, message):
    with pytest.raises(IncompatiblePeer, match=message.replace("[", r"\[").replace("]", r"\]")):
        route_heads(src, dst)


def test_a_plan_refuses_heads_one_side_does_not_hold():
    src, dst = model(4, 2), model(4, 2)
    with pytest.raises(ValueError, match=r"heads \(2,\) are not distinct heads held by both sides"):
        make_plan(src[0], [0], 0, 16, dst[0], [1], heads=(2,))


def decode_group(total=2, tp=4) -> DecodeGroup:
    return DecodeGroup(tp, tuple(DecodeRank(r, f"D-r{r}", f"D-r{r}-t", lay) for r, lay in enumerate(model(total, tp))))


def test_rank_parts_name_each_decode_ranks_transfer_id_and_peer():
    parts = rank_parts(model(2, 2), decode_group())
    assert {r: [(p.dst_rank, p.transfer_id, p.peer, p.heads) for p in ps] for r, ps in parts.items()} == {
        0: [(0, "D-r0-t", "D-r0", (0,)), (1, "D-r1-t", "D-r1", (0,))],
        1: [(2, "D-r2-t", "D-r2", (1,)), (3, "D-r3-t", "D-r3", (1,))],
    }


def test_the_decode_group_crosses_a_reservation_and_one_without_it_is_tp1():
    fields = dict(instance="D", request_id="r", block_ids=[3, 1], block_size=16, num_tokens=20, lease_s=5.0)
    today = Reservation(transfer_id="D-t", kv_target={"peer": "D", "epoch": "e"}, **fields)
    assert json.loads(today.model_dump_json())["kv_target"] == {"peer": "D", "epoch": "e"}  # no "tp": null
    assert Reservation.model_validate_json(today.model_dump_json()).kv_target.tp is None
    tp_target = {"peer": "D", "epoch": "e", "tp": group_to_builtins(decode_group())}
    tp = Reservation(transfer_id="D-r0-t", kv_target=tp_target, **fields)
    assert json.loads(tp.model_dump_json())["kv_target"] == tp_target
    assert Reservation.model_validate_json(tp.model_dump_json()).kv_target.tp == decode_group()


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(tp_size=3), "tp_size 3 with 4 ranks"),
        (lambda t: t["ranks"].reverse(), "entry 0 is rank 3"),
        (lambda t: t["ranks"][1].update(peer="D-r0"), "ranks repeat a peer"),
        (lambda t: t["ranks"][1].update(transfer_id=""), "rank 1 needs a peer and a transfer id"),
        (lambda t: t["ranks"][0]["layout"].update(head_ids=[7]), r"head_ids \(7,\) outside \[0, 2\)"),
        (lambda t: t["ranks"][0].update(extra=1), "Object contains unknown field `extra`"),
        (lambda t: t.update(ranks="x"), "Expected `array`, got `str`"),
    ],
)
def test_a_malformed_decode_group_is_refused_naming_what_is_wrong(change, message):
    tp = group_to_builtins(decode_group())
    change(tp)
    with pytest.raises(ValueError, match=message):
        parse_group(tp)
    with pytest.raises(ValidationError, match=message):  # where a reservation enters a process
        KVTarget.model_validate({"peer": "D", "tp": tp})


def test_the_tp_benchmark_counts_the_bytes_of_each_link():
    src = [bench._layout(BENCH_ARGS, r, 2) for r in range(2)]
    dst = [bench._layout(BENCH_ARGS, r, 4) for r in range(4)]
    per_head = 64 * 3 * 2 * 16 * 2  # tokens, layers, K and V, head_dim, bfloat16
    assert bench.link_bytes(src, dst, 64) == {f"P{d // 2}->D{d}": per_head for d in range(4)}
    # the whole cache (64 tokens), each head twice: D replicates them
    assert sum(bench.link_bytes(src, dst, 64).values()) == 2 * bench._layout(BENCH_ARGS).total_bytes


@pytest.mark.parametrize("text,message", [("2", "two rank counts"), ("2,x", "two rank counts"), ("0,2", "1 to 64")])
def test_the_tp_benchmark_refuses_a_bad_pair(text, message):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tp", text])
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        bench._tp_pair(text)
