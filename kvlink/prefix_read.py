"""Decode-to-prefill reuse: a prefill server reads a reservation's cached prefix back from its decode server.

The next turn of a conversation is reserved on the decode server that answered
the last one; its reservation pins the blocks it already holds of the prompt
(``num_cached_tokens``: the earlier turns, answers included). A prefill server
whose own cache holds less of the prompt reads those tokens' K/V from it instead
of computing them, under the reservation's transfer id and within its lease::

    router ── /generate ──▶ D  reserve: cached prefix pinned, transfer id T, lease
    router ── /prefill  ──▶ P  P holds less than num_cached_tokens:
                               P ── POST /kv/read {T, start, end} ──▶ D   (engine thread: T still waits for
                               P ◀── tokens' K/V; headers: T, range, CRC32    its KV, the range's blocks pinned;
                                                                              copied out on another thread)
                               P checks the checksum, offers the blocks to its engine
                               (engine/tiers/offered.py), computes only the rest and pushes
                               tokens [num_cached_tokens, n) into T as always

The bytes ride the authenticated internal HTTP route of the decode server that the
handshake already uses (kvlink/peers.py), in a layout-free order (layer, K|V,
token, head, width), so P and D may have different block sizes and orders. The
answer's body is those bytes as they lie in the tensor D copied out, and its
headers say what they are (transfer id, range, dtype, shape, CRC32): no frame
around the bytes, so D sends the tensor's memory and P reads the body once,
into the buffer the tensor is made over (``fetch_prefix``, on a worker thread
with a blocking socket: an asyncio HTTP client reads 64 KiB at a time through
the event loop, two to seven times slower for megabytes). P checks every
header and that the body's length is the shape's before allocating anything.
A read that fails in any way (D gone, refused, timed out, a checksum, header
or shape that does not match) is a miss: P computes the prefix itself.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from transfer.outcome import Outcome

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONTENT_TYPE = "application/x-pdserve-prefix-kv-raw"
TRANSFER_HEADER = "x-pdserve-transfer-id"
RANGE_HEADER = "x-pdserve-range"  # "start-end"
DTYPE_HEADER = "x-pdserve-dtype"
SHAPE_HEADER = "x-pdserve-shape"  # "layers,2,tokens,heads,width"
CHECKSUM_HEADER = "x-pdserve-crc32"  # of the body, computed where it was read
MAX_ERROR_BYTES = 65536  # of a refusal's body, read for its ErrorReply code


class PrefixReadError(RuntimeError):
    """A read of a decode server's prefix that cannot be used; ``outcome`` says why (a miss either way)."""

    def __init__(self, outcome: Outcome, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome


@dataclass(frozen=True)
class PrefixHeader:
    """What an answer's headers say its body is: tokens [start, end)'s K/V, [layers, K|V, tokens, heads, width]."""

    transfer_id: str
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    checksum: int

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def crc32(data: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def encode_prefix(
    transfer_id: str, start: int, end: int, tokens: torch.Tensor, corrupt: bool = False
) -> tuple[dict[str, str], memoryview]:
    """What a decode server answers: its headers and its body, a view of ``tokens``' memory (which it keeps
    alive); ``corrupt``: one byte flipped after the checksum (fault injection; the bytes copied first)."""
    dtype = next(name for name, dt in DTYPES.items() if dt == tokens.dtype)
    data = tokens.contiguous().reshape(-1).view(torch.uint8).numpy().data
    checksum = crc32(data)
    if corrupt and len(data):
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        data = memoryview(flipped)
    headers = {
        TRANSFER_HEADER: transfer_id,
        RANGE_HEADER: f"{start}-{end}",
        DTYPE_HEADER: dtype,
        SHAPE_HEADER: ",".join(str(n) for n in tokens.shape),
        CHECKSUM_HEADER: str(checksum),
    }
    return headers, data


def check_header(
    headers: Mapping[str, str],
    length: int | None,
    transfer_id: str,
    start: int,
    end: int,
    fits: tuple[int, int, int, int] | None = None,
) -> PrefixHeader:
    """An answer's headers and body length (``Content-Length``), checked before its body is read: the
    transfer and range asked for, a known dtype, a shape of those tokens that holds exactly ``length``
    bytes and, given ``fits`` (layers, 2, heads, width of the reader's cache), one the reader's cache can
    take. PrefixReadError otherwise."""
    try:
        first, last = (int(n) for n in headers[RANGE_HEADER].split("-"))
        shape = tuple(int(n) for n in headers[SHAPE_HEADER].split(","))
        meta = PrefixHeader(
            headers[TRANSFER_HEADER], first, last, DTYPES[headers[DTYPE_HEADER]], shape, int(headers[CHECKSUM_HEADER])
        )
    except (KeyError, ValueError) as exc:
        raise PrefixReadError(Outcome.BAD_NOTICE, f"a prefix read's answer has a bad header: {exc!r}"[:300]) from None
    if (meta.transfer_id, meta.start, meta.end) != (transfer_id, start, end):
        raise PrefixReadError(Outcome.BAD_NOTICE, "a prefix read's answer is for another transfer or range")
    if len(shape) != 5 or shape[2] != end - start or min(shape) <= 0:
        raise PrefixReadError(Outcome.BAD_NOTICE, f"a prefix read's answer has shape {shape[:8]}")
    if fits is not None and (shape[0], shape[1], shape[3], shape[4]) != fits:
        raise PrefixReadError(Outcome.BAD_NOTICE, f"a prefix read's answer of shape {shape} does not fit {fits}")
    if length != meta.nbytes:
        raise PrefixReadError(Outcome.BAD_NOTICE, "a prefix read's answer does not hold its shape's bytes")
    return meta


def decode_prefix(meta: PrefixHeader, data: bytearray) -> torch.Tensor:
    """The tokens' K/V over ``data`` (no copy), once its length and checksum match ``meta``."""
    if len(data) != meta.nbytes:
        raise PrefixReadError(Outcome.BAD_NOTICE, "a prefix read's answer does not hold its shape's bytes")
    if crc32(data) != meta.checksum:
        raise PrefixReadError(Outcome.CHECKSUM_MISMATCH, "a prefix read's bytes do not match their checksum")
    return torch.frombuffer(data, dtype=torch.uint8).view(meta.dtype).reshape(meta.shape)


def fetch_prefix(
    url: str,
    headers: Mapping[str, str],
    transfer_id: str,
    start: int,
    end: int,
    timeout_s: float,
    fits: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """POST ``{url}/kv/read`` for tokens [start, end) of ``transfer_id``, on a connection of its own, and
    its checked answer (``check_header``; blocking: run on a worker thread). Within ``timeout_s`` in all;
    PrefixReadError."""
    deadline = time.monotonic() + timeout_s
    parts = urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=timeout_s)
    body = json.dumps({"transfer_id": transfer_id, "start": start, "end": end})
    at = 0
    try:
        conn.request("POST", f"{parts.path.rstrip('/')}/kv/read", body, {**headers, "content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200 or resp.getheader("content-type") != CONTENT_TYPE:
            code = _code(resp.read(MAX_ERROR_BYTES))
            raise PrefixReadError(Outcome.REFUSED, f"the decode server refused the read (HTTP {resp.status} {code})")
        length = resp.getheader("content-length")
        answer = {k.lower(): v for k, v in resp.getheaders()}
        size = int(length) if length and length.isdigit() else None
        meta = check_header(answer, size, transfer_id, start, end, fits)
        data = bytearray(meta.nbytes)
        view = memoryview(data)
        while at < len(data):
            if time.monotonic() > deadline:
                raise TimeoutError
            n = resp.readinto(view[at:])
            if not n:
                raise http.client.IncompleteRead(b"", len(data) - at)
            at += n
    except TimeoutError:
        raise PrefixReadError(Outcome.TIMED_OUT, "the decode server did not answer in time") from None
    except http.client.IncompleteRead:
        raise PrefixReadError(Outcome.BAD_NOTICE, f"a prefix read's answer ended after {at} bytes") from None
    except (OSError, http.client.HTTPException) as exc:
        raise PrefixReadError(Outcome.UNREACHABLE, f"the decode server: {exc!r}"[:300]) from None
    finally:
        conn.close()
    return decode_prefix(meta, data)


def _code(body: bytes) -> str:
    """The ``code`` of an ErrorReply body ("" when it is none)."""
    try:
        code = json.loads(body).get("code", "")
    except (ValueError, AttributeError):
        return ""
    return code if isinstance(code, str) else ""
