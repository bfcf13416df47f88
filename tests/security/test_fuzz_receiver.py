"""Hypothesis fuzzes a live ZeroMQ receiver (real sockets on 127.0.0.1) with
frames a hostile peer could send: headers with random sizes, offsets, layers
and ids, truncated and oversized payloads, extra and missing frames, random
notices (the same path NIXL notifications take), from a bound identity and
from strangers. The receiver never dies, never writes a byte outside the
reserved blocks, and still completes a real transfer afterwards."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.wire import bound_socket, connect_as, ping, sender_hello, write_frames
from tests.transfer.helpers import make_sender, meet, push_all, wait_events
from transfer.copy import region_bytes
from transfer.factory import make_backend
from transfer.layout import KVLayout
from transfer.messages import Cancel, CancelAck, Done, encode
from transfer.receiver import KVReceiver

LAYOUT = KVLayout.for_engine_cache(
    num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32"
)
RESERVED = [5, 2]
INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
SIZES = st.one_of(st.integers(0, 4096), st.integers(0, 1 << 62), st.sampled_from([LAYOUT.block_bytes, 1 << 50]))


@pytest.fixture(scope="module")
def live():
    cache = torch.zeros(LAYOUT.shape)
    receiver = KVReceiver(make_backend("zmq", "D", endpoint="tcp://127.0.0.1:0"), cache, LAYOUT, name="D", model="m")
    receiver.start()
    ctx = zmq.Context()
    sock = bound_socket(ctx, receiver.accept(sender_hello("fuzzer", "m", LAYOUT)))
    stranger = connect_as(ctx, receiver.backend.endpoint, b"p0")
    yield receiver, cache, sock, stranger
    sock.close()
    stranger.close()
    ctx.term()
    receiver.close()


def outside_reserved(cache: torch.Tensor) -> np.ndarray:
    """Every byte of the cache that no block of RESERVED holds."""
    region = region_bytes(cache).numpy().reshape(LAYOUT.num_layers, 2, LAYOUT.num_blocks, LAYOUT.block_bytes)
    others = [b for b in range(LAYOUT.num_blocks) if b not in RESERVED]
    return region[:, :, others]


@st.composite
def messages(draw, live_tid: str) -> list[bytes]:
    kind = draw(st.sampled_from(["write", "write", "write", "notice", "raw"]))
    if kind == "raw":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=5))
    if kind == "notice":
        tid = draw(st.sampled_from([live_tid, "nope", ""]))
        msg = draw(
            st.sampled_from(
                [
                    Done(
                        tid,
                        "fuzzer",
                        tuple(draw(st.lists(INT64, max_size=20))),
                        draw(INT64),
                        draw(INT64),
                        tuple(draw(st.lists(INT64, max_size=3))),
                        draw(st.integers(0, (1 << 64) - 1)),
                        draw(st.sampled_from(["sampled", "all", "none", "x"])),
                    ),
                    Cancel(tid),
                    CancelAck(tid, "fuzzer"),
                ]
            )
        )
        return [encode(msg)]
    n = draw(st.integers(0, 6))
    offsets = draw(st.lists(st.one_of(INT64, st.integers(0, LAYOUT.total_bytes)), min_size=n, max_size=n))
    lengths = draw(st.lists(st.one_of(INT64, st.integers(0, 2 * LAYOUT.block_bytes)), min_size=n, max_size=n))
    frames = write_frames(
        draw(st.sampled_from([live_tid, "nope"])),
        draw(st.integers(-2, 4)),
        offsets,
        lengths,
        nbytes=draw(st.one_of(st.none(), SIZES)),
        payload=draw(st.one_of(st.none(), st.binary(max_size=512))),
    )
    cut = draw(st.integers(1, 5))  # truncated (missing frames) or with extra frames
    return frames[:cut] if cut < 4 else frames + [b"extra"] * (cut - 4)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_fuzzed_frames_never_kill_the_receiver_or_land_outside_the_reservation(live, data):
    receiver, cache, sock, stranger = live
    tid = receiver.expect(RESERVED, lease_s=30)
    for _ in range(data.draw(st.integers(1, 4))):
        frames = data.draw(messages(tid))
        target = data.draw(st.sampled_from([sock, sock, stranger]))
        target.send_multipart(frames)
    ping(sock, "ping")  # everything sent before it has been handled
    assert receiver.problem(stuck_after_s=5.0) is None
    assert not outside_reserved(cache).any()
    receiver.cancel(tid)


def test_after_the_fuzzing_a_real_transfer_still_completes(live):
    receiver, cache, _, _ = live
    sender = make_sender("zmq", None, "P", LAYOUT, model="m")
    try:
        receiver.take_finished()  # what the fuzzing ended
        peer = meet(sender, receiver)
        tid = receiver.expect([1], lease_s=10)
        sender.begin(tid, peer, [1], lease_s=10)
        push_all(sender, tid, LAYOUT, [3], 0, 4, first_tokens=(7,))
        # The fuzzing's last cancel may end after the take above: wait for this transfer's own end.
        got = wait_events(receiver)
        deadline = time.monotonic() + 10
        while tid not in {e.transfer_id for e in got.ended} and time.monotonic() < deadline:
            got.ended += wait_events(receiver).ended
        assert [(c.transfer_id, c.first_tokens) for c in got.completed if c.transfer_id == tid] == [(tid, (7,))]
        counters = receiver.counters()
        assert counters["contained_errors"] == 0
        assert counters["dropped_unbound_identity"] > 0 and counters["dropped_malformed"] > 0
    finally:
        sender.close()
