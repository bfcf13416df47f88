"""Talking to a decode server's ZeroMQ KV port as a stranger or as a bound peer would."""

from __future__ import annotations

import msgspec
import numpy as np
import zmq

from transfer.layout import KVLayout
from transfer.messages import Ack, Done, Hello, WriteHeader, decode, encode

ACK_TIMEOUT_MS = 10_000


def sender_hello(name: str, model: str, layout: KVLayout) -> bytes:
    """A prefill-side hello for the ZeroMQ backend, as KVSender makes it."""
    meta = msgspec.msgpack.encode({"name": name, "endpoint": None})
    return encode(Hello("prefill", name, model, layout, "zmq", meta))


def connect_as(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def bound_socket(ctx: zmq.Context, receiver_hello: bytes) -> zmq.Socket:
    """A DEALER with the identity the receiver assigned us in its answer to our hello."""
    hello = msgspec.msgpack.decode(receiver_hello, type=Hello)
    meta = msgspec.msgpack.decode(hello.backend_meta)
    return connect_as(ctx, meta["endpoint"], meta["identity"])


def write_frames(
    transfer_id: str, layer: int, offsets, lengths, nbytes: int | None = None, payload: bytes | None = None
) -> list[bytes]:
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    nbytes = int(lengths.sum()) if nbytes is None else nbytes
    data = bytes(min(max(0, int(lengths.sum())), 1 << 16)) if payload is None else payload
    return [encode(WriteHeader(transfer_id, layer, len(lengths), nbytes)), offsets.tobytes(), lengths.tobytes(), data]


def ping(sock: zmq.Socket, tag: str) -> Ack:
    """A Done for an id nobody issued; its refusal comes back after everything sent before it was handled."""
    sock.send(encode(Done(tag, "fuzz", (0,), 0, 0, (), 0, "none")))
    if not sock.poll(ACK_TIMEOUT_MS):
        raise AssertionError("the receiver did not answer within 10 s")
    while True:
        msg = decode(sock.recv())
        if isinstance(msg, Ack) and msg.transfer_id == tag:
            return msg
