"""The transfer benchmark across two hosts: its control channel and addresses.

`pdserve bench transfer --listen HOST:PORT` on the receiving host waits for
one sender; `pdserve bench transfer --peer HOST:PORT` on the sending host
connects to it (retrying while the receiver starts) and runs the benchmark
as it does with a local receiver process (bench/micro/transfer.py). The control
channel carries the same messages as the local pipe: the two backends'
hellos (msgpack made by ``transfer``) and small JSON commands, each framed
as a 4-byte big-endian length and its bytes, nothing unpickled. The first
message is the sender's shape of the cache (``SHAPE_KEYS`` and the backend),
so only the sender names it. KV bytes go over the backend (UCX or ZeroMQ) on
the interface that holds the given address, never over this channel.

The listener serves one sender and exits; it allocates the cache the sender
asks for (at most ``MAX_CACHE_BYTES``): run it on a network you trust.
"""

from __future__ import annotations

import socket
import struct
import time

SHAPE_KEYS = ("backend", "layers", "blocks", "block_size", "kv_heads", "head_dim", "dtype", "kv_order")
MAX_MESSAGE_BYTES = 16 << 20
MAX_CACHE_BYTES = 64 << 30


def split_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ValueError naming the text otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """The address this machine sends from to reach ``host`` (a UDP connect sends nothing)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family[0], socket.SOCK_DGRAM) as sock:
        sock.connect(family[4])
        return sock.getsockname()[0]


class SocketConn:
    """``send_bytes`` / ``recv_bytes`` (as a multiprocessing pipe end) over a TCP socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send_bytes(self, data: bytes) -> None:
        self._sock.sendall(struct.pack(">I", len(data)) + data)

    def recv_bytes(self) -> bytes:
        (size,) = struct.unpack(">I", self._recv_exact(4))
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"control message of {size} bytes, more than {MAX_MESSAGE_BYTES}")
        return self._recv_exact(size)

    def _recv_exact(self, size: int) -> bytes:
        buf = bytearray()
        while len(buf) < size:
            chunk = self._sock.recv(size - len(buf))
            if not chunk:
                raise ConnectionError("the other side of the benchmark closed the control channel")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()


def accept_one(host: str, port: int, announce) -> SocketConn:
    """Listens on (host, port), calls ``announce(address)`` once listening, returns the first sender."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family[0], socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(family[4])
        listener.listen(1)
        bound = listener.getsockname()
        announce(f"{bound[0]}:{bound[1]}")
        sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return SocketConn(sock)


def connect(host: str, port: int, timeout_s: float) -> SocketConn:
    """Connects to a listening receiver, retrying until ``timeout_s`` (it may still be starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
        except OSError as err:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no benchmark receiver answered at {host}:{port} within {timeout_s} s") from err
            time.sleep(0.2)
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return SocketConn(sock)
