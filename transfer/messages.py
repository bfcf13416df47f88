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

MAX_TP = 64  # ranks in one TP group, at most
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
    the token each of the request's sequences starts with (one per sequence, n > 1).
    ``layer_starts``: empty when every layer was sent for tokens [token_start, token_end);
    else one per layer, layer l sent (and checksummed) for [layer_starts[l], token_end)
    (sliding-window layers send a prompt's last tokens only)."""

    transfer_id: str
    sender: str
    first_tokens: tuple[int, ...]
    token_start: int
    token_end: int
    heads: tuple[int, ...]
    checksum: int
    checksum_mode: str  # "sampled" | "all" | "none"
    layer_starts: tuple[int, ...] = ()


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    transfer_id: str
    ok: bool
    reason: str = ""


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    transfer_id: str


class CancelAck(msgspec.Struct, frozen=True, tag="cancel_ack"):
    transfer_id: str
    sender: str


class DecodeRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One decode rank in a reservation: its transfer id, the agent name its
    receiver answered the handshake with (``Hello.name``), and its layout."""

    rank: int
    peer: str
    transfer_id: str
    layout: KVLayout


class DecodeGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The decode side's TP layout, carried in a reservation's ``kv_target["tp"]``
    (absent for tp_size 1: the reservation's own transfer id is then the only one).
    Every rank's blocks are the reservation's ``block_ids`` (one block table)."""

    tp_size: int
    ranks: tuple[DecodeRank, ...]


def single_rank(transfer_id: str, peer: str, layout: KVLayout) -> DecodeGroup:
    """A tp_size 1 decode server as a group: a reservation without ``kv_target["tp"]``
    (its transfer id; the peer and layout its handshake gave)."""
    return DecodeGroup(1, (DecodeRank(0, peer, transfer_id, layout),))


def group_to_builtins(group: DecodeGroup) -> dict:
    """``kv_target["tp"]``: JSON-ready builtins (lists, dicts, numbers, strings)."""
    return msgspec.json.decode(msgspec.json.encode(group))


def parse_group(raw: object) -> DecodeGroup:
    """The decode group of a reservation's ``kv_target["tp"]``. Raises ValueError naming what
    is wrong: it came over the network."""
    try:
        group = raw if isinstance(raw, DecodeGroup) else msgspec.convert(raw, DecodeGroup)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ValueError(f"kv_target.tp: {exc}") from None
    if not 1 <= group.tp_size <= MAX_TP or len(group.ranks) != group.tp_size:
        raise ValueError(f"kv_target.tp: tp_size {group.tp_size} with {len(group.ranks)} ranks")
    for i, rank in enumerate(group.ranks):
        if rank.rank != i or (rank.layout.tp_rank, rank.layout.tp_size) != (i, group.tp_size):
            raise ValueError(f"kv_target.tp: entry {i} is rank {rank.rank} (layout rank {rank.layout.tp_rank})")
        if not (1 <= len(rank.peer) <= 200 and 1 <= len(rank.transfer_id) <= 200):
            raise ValueError(f"kv_target.tp: rank {i} needs a peer and a transfer id of 1 to 200 characters")
    peers, tids = {r.peer for r in group.ranks}, {r.transfer_id for r in group.ranks}
    if len(peers) != group.tp_size or len(tids) != group.tp_size:
        raise ValueError("kv_target.tp: ranks repeat a peer or a transfer id")
    return group


Message = Hello | WriteHeader | Done | Ack | Cancel | CancelAck

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raises msgspec.DecodeError on anything malformed."""
    return _decoder.decode(data)
