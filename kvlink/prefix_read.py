"""Decode-to-prefill reuse: a prefill server reads a reservation's cached prefix back from its decode server.

The next turn of a conversation is reserved on the decode server that answered
the last one; its reservation pins the blocks it already holds of the prompt
(``num_cached_tokens``: the earlier turns, answers included). A prefill server
whose own cache holds less of the prompt reads those tokens' K/V from it instead
of computing them, under the reservation's transfer id and within its lease::

    router ── /generate ──▶ D  reserve: cached prefix pinned, transfer id T, lease
    router ── /prefill  ──▶ P  P holds less than num_cached_tokens:
                               P ── POST /kv/read {T, start, end} ──▶ D   (engine thread: T still waits
                               P ◀── PrefixKV (tokens' K/V, CRC32) ───    for its KV, the range is pinned)
                               P checks the checksum, offers the blocks to its engine
                               (engine/tiers/offered.py), computes only the rest and pushes
                               tokens [num_cached_tokens, n) into T as always

The bytes ride the authenticated internal HTTP route of the decode server that the
handshake already uses (kvlink/peers.py), in a layout-free order (layer, K|V,
token, head, width), so P and D may have different block sizes and orders. A
read that fails in any way (D gone, refused, timed out, a checksum or shape
that does not match) is a miss: P computes the prefix itself.
"""

from __future__ import annotations

import zlib

import msgspec
import torch

from transfer.outcome import Outcome

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONTENT_TYPE = "application/x-pdserve-prefix-kv"


class PrefixReadError(RuntimeError):
    """A read of a decode server's prefix that cannot be used; ``outcome`` says why (a miss either way)."""

    def __init__(self, outcome: Outcome, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome


class PrefixKV(msgspec.Struct, frozen=True):
    """The answer to POST /kv/read: tokens [start, end)'s K/V, [layers, K|V, tokens, heads, width]."""

    transfer_id: str
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    checksum: int  # CRC32 of ``data``, computed where it was read
    data: bytes


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def encode_prefix(transfer_id: str, start: int, end: int, tokens: torch.Tensor, corrupt: bool = False) -> bytes:
    """What a decode server answers; ``corrupt``: one byte flipped after the checksum (fault injection)."""
    dtype = next(name for name, dt in DTYPES.items() if dt == tokens.dtype)
    data = tokens.contiguous().view(torch.uint8).numpy().tobytes()
    checksum = crc32(data)
    if corrupt and data:
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        data = bytes(flipped)
    return msgspec.msgpack.encode(PrefixKV(transfer_id, start, end, dtype, tuple(tokens.shape), checksum, data))


def decode_prefix(payload: bytes, transfer_id: str, start: int, end: int) -> torch.Tensor:
    """The tokens' K/V out of a decode server's answer, checked: the transfer and range asked for, a
    known dtype, a shape that holds the bytes, and the checksum. PrefixReadError otherwise."""
    try:
        msg = msgspec.msgpack.decode(payload, type=PrefixKV)
    except msgspec.DecodeError as exc:
        raise PrefixReadError(Outcome.BAD_NOTICE, f"a prefix read's answer is malformed: {exc}") from None
    if (msg.transfer_id, msg.start, msg.end) != (transfer_id, start, end):
        raise PrefixReadError(Outcome.BAD_NOTICE, "a prefix read's answer is for another transfer or range")
    dtype = DTYPES.get(msg.dtype)
    shape = msg.shape
    if dtype is None or len(shape) != 5 or shape[2] != end - start or min(shape) <= 0:
        raise PrefixReadError(Outcome.BAD_NOTICE, f"a prefix read's answer has dtype {msg.dtype!r}, shape {shape}")
    if len(msg.data) != dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]:
        raise PrefixReadError(Outcome.BAD_NOTICE, "a prefix read's answer does not hold its shape's bytes")
    if crc32(msg.data) != msg.checksum:
        raise PrefixReadError(Outcome.CHECKSUM_MISMATCH, "a prefix read's bytes do not match their checksum")
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)
