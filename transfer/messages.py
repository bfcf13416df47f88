"""Data-plane messages, msgpack-encoded with msgspec (never pickle).

Handshake (exchanged once per prefill/decode pair over the control plane)::

    P --Hello(role="prefill")--> D   D checks compatibility, answers:
    P <--Hello(role="decode")--- D   P checks compatibility, connects

Per transfer, sender -> receiver:  WriteHeader (message backends only,
followed by frames: dst offsets int64, lengths int64, payload), then Done.
Receiver -> sender: Ack (KV accepted or refused), Cancel (lease expired or
request gone: stop writing). Sender -> receiver: CancelAck (nothing of that
transfer is in flight any more).
"""

from __future__ import annotations

import msgspec

from transfer.layout import KVLayout

MAX_SEQUENCES = 16  # first tokens per Done notice at most: engine.request.MAX_N (transfer imports no engine)


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    role: str  # "prefill" | "decode"
    name: str  # unique instance name; also the backend's agent name
    model: str
    layout: KVLayout
    backend: str  # "nixl" | "zmq" | "inproc"
    backend_meta: bytes
    # Drawn at every start of the process: a decode server keeps a name bound to the
    # instance that met it first while that one is connected (see KVReceiver.accept).
    instance: str = ""


class WriteHeader(msgspec.Struct, frozen=True, tag="write"):
    transfer_id: str
    layer: int
    num_ranges: int
    nbytes: int


class Done(msgspec.Struct, frozen=True, tag="done"):
    """Everything of ``transfer_id`` this sender writes has been written. ``first_tokens``:
    the token each of the request's sequences starts with (one per sequence, n > 1)."""

    transfer_id: str
    sender: str
    first_tokens: tuple[int, ...]
    token_start: int
    token_end: int
    heads: tuple[int, ...]
    checksum: int
    checksum_mode: str  # "sampled" | "all" | "none"


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    transfer_id: str
    ok: bool
    reason: str = ""


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    transfer_id: str


class CancelAck(msgspec.Struct, frozen=True, tag="cancel_ack"):
    transfer_id: str
    sender: str


Message = Hello | WriteHeader | Done | Ack | Cancel | CancelAck

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raises msgspec.DecodeError on anything malformed."""
    return _decoder.decode(data)
