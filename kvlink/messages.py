"""Rank 0 <-> a tensor-parallel rank's transfer agent (``kvlink.agent``): typed messages.

They travel as JSON objects on the engine's rank pipes (``engine.tp_leader``
``send_message`` down, the agent's ``Reply`` up), between the steps and in
order with them; ``op`` names the message. Bytes (handshake messages) go as
base64. A message that asks for an answer carries an ``id`` and gets one
``Answer`` with it (``error`` set when it failed); ``PartEnded`` comes
unasked for every part the rank's sender or receiver saw end::

    Open       role, backend, name, model, timeout_s, host, advertise -> Answer(layout)
    AskHello                                    -> Answer(hello)
    Connect    hello, timeout_s  (sender)       -> Answer(peer)
    Accept     hello, timeout_s  (receiver)     -> Answer(hello)
    Expect     blocks, lease_s, writable_from   -> Answer(tid)       (receiver)
    CancelPart tid, reason                                           (receiver)
    Begin      tid, peer, blocks, deadline, heads (deadline: time.monotonic() on this host)
    Push       tid, layer, blocks, start, end  a layer's tokens [start, end), sent while rank 0 computes
                                        that layer; the rank takes it after the step, once its own
                                        forward wrote every layer
    Finish     tid, first_tokens
    Abort      tid
    Forget     peer
"""

from __future__ import annotations

import msgspec

from transfer.layout import KVLayout


class _ToRank(msgspec.Struct, frozen=True, tag_field="op"):
    pass


class Open(_ToRank, frozen=True, tag="open"):
    id: int
    role: str  # "prefill" (a KVSender) | "decode" (a KVReceiver)
    backend: str
    name: str
    model: str
    timeout_s: float
    host: str = ""  # a ZeroMQ receiver binds a port the system picks here
    advertise: str = ""


class AskHello(_ToRank, frozen=True, tag="hello"):
    id: int


class Connect(_ToRank, frozen=True, tag="connect"):
    id: int
    hello: bytes
    timeout_s: float


class Accept(_ToRank, frozen=True, tag="accept"):
    id: int
    hello: bytes
    timeout_s: float


class Expect(_ToRank, frozen=True, tag="expect"):
    id: int
    blocks: list[int]
    lease_s: float
    writable_from: int


class CancelPart(_ToRank, frozen=True, tag="cancel"):
    tid: str
    reason: str


class Begin(_ToRank, frozen=True, tag="begin"):
    tid: str
    peer: str
    blocks: list[int]
    deadline: float
    heads: tuple[int, ...]


class Push(_ToRank, frozen=True, tag="push"):
    tid: str
    layer: int
    blocks: list[int]
    start: int
    end: int


class Finish(_ToRank, frozen=True, tag="finish"):
    tid: str
    first_tokens: list[int]


class Abort(_ToRank, frozen=True, tag="abort"):
    tid: str


class Forget(_ToRank, frozen=True, tag="forget"):
    peer: str


ToRank = Open | AskHello | Connect | Accept | Expect | CancelPart | Begin | Push | Finish | Abort | Forget
Asking = Open | AskHello | Connect | Accept | Expect  # the messages answered with an ``Answer``


class Answer(msgspec.Struct, frozen=True, tag="answer", tag_field="op"):
    id: int
    error: str = ""
    layout: KVLayout | None = None
    hello: bytes = b""
    peer: str = ""
    tid: str = ""


class PartEnded(msgspec.Struct, frozen=True, tag="ended", tag_field="op"):
    tid: str
    outcome: str
    reason: str
    first_tokens: tuple[int, ...] | None
    at: float


FromRank = Answer | PartEnded


def to_pipe(message: ToRank | FromRank) -> dict:
    return msgspec.to_builtins(message)


def to_rank(raw: dict) -> ToRank:
    return msgspec.convert(raw, ToRank)


def from_rank(raw: dict) -> FromRank:
    return msgspec.convert(raw, FromRank)
