"""ZeroMQ backend: for machines without NIXL.

Sockets (every endpoint comes from config)::

    sender  DEALER(identity=token) --connect--> ROUTER(bind endpoint)  receiver
            frames: [WriteHeader][dst offsets int64][lengths int64][payload]
                    [Done]                  acks and cancels come back on the
                                            same connection, ROUTER -> identity

Identities are bound by the authenticated handshake, never announced: when
the receiver ``connect``s a sender (from the hello it got over the control
plane, which needs the internal secret) it draws a random token for it and
hands it back in ``metadata_for``; the sender's DEALER connects with that
token as its identity. Frames from any other identity (a process that
connected on its own, whatever name it claims) are dropped and counted, and
the ROUTER does not hand an identity in use over to a second connection
(no ``ROUTER_HANDOVER``), so nobody takes a bound peer's place. A restarted
sender handshakes again and gets a new token; the old one is forgotten. A
hello under a bound name is only connected once the bound sender's connection
is gone (``peer_connected``; ``KVReceiver.accept`` asks).

Every write header is checked before anything is allocated: its sizes must
agree with its frames, and its byte count must fit what the transfer's
reservation holds (``set_write_limit``); anything else is drained from the
socket and reported as ``Dropped``.

The sender gathers one layer's ranges into one packed frame (a view of the
cache, no copy, when the plan is a single range) and sends it with
``copy=False``. The receiver ``recv_into``s the payload into a preallocated
staging buffer and the receiver scatters it into the cache with numpy fancy
indexing, after checking the transfer id and the reserved blocks.

Sends never block the transfer thread: with ``IMMEDIATE`` a frame is only
queued on a live connection, otherwise it waits in an ordered outbox until
``connect_timeout_s``; a monitor socket reports a dropped connection.
"""

from __future__ import annotations

import secrets
import time
from collections import deque

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from transfer.backend import Backend, Dropped, NoticeIn, PeerLost, TransferError, WriteIn
from transfer.copy import gather, region_bytes, scatter
from transfer.messages import WriteHeader, decode, encode

MAX_RANGES = 1 << 20  # ranges in one write (a layer of a 64k-token prompt in 1-token blocks is 128k)


class _Peer:
    def __init__(self, sock, monitor) -> None:
        self.sock = sock
        self.monitor = monitor
        self.outbox: deque[tuple[list, float]] = deque()  # (frames, give-up time)
        self.failed = ""


class ZmqBackend(Backend):
    kind = "zmq"
    one_sided = False

    def __init__(
        self, name: str, endpoint: str | None = None, connect_timeout_s: float = 5.0, advertise_host: str | None = None
    ) -> None:
        """``endpoint``: where a receiver binds its ROUTER (``tcp://127.0.0.1:5601``;
        port 0 picks a free one, see ``endpoint``). Senders need none. ``advertise_host``: the
        address senders reach it at, when that is not the bound one (a wildcard bind, NAT)."""
        self.name = name
        self._ctx = zmq.Context(io_threads=1)
        self._timeout = connect_timeout_s
        self._regions: dict[str, object] = {}
        self._peers: dict[str, _Peer] = {}
        self._poller = zmq.Poller()
        self._staging = np.empty(0, dtype=np.uint8)
        self._write_limit = lambda transfer_id: None  # no reservation known: every write is refused
        self._identity_of: dict[str, bytes] = {}  # sender name -> the identity we assigned it (receiver)
        # Receiver: when each sender was met, and those whose connection the ROUTER has routed to since
        # (``peer_connected``: a sender met moments ago may not have connected yet).
        self._met_at: dict[str, float] = {}
        self._routed: set[str] = set()
        self._peer_of: dict[bytes, str] = {}  # and back
        self.endpoint = None
        self._router = None
        if endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown identity -> error, not silence
            self._router.setsockopt(zmq.RCVHWM, 0)
            host, _, port = endpoint.rpartition(":")
            if port == "0":
                self._router.bind_to_random_port(host)
            else:
                self._router.bind(endpoint)
            self.endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
            if advertise_host:
                port = self.endpoint.rpartition(":")[2]
                self.endpoint = (
                    f"tcp://[{advertise_host}]:{port}" if ":" in advertise_host else f"tcp://{advertise_host}:{port}"
                )
            self._poller.register(self._router, zmq.POLLIN)

    def register(self, region: str, tensor) -> None:
        if tensor.is_cuda:
            raise NotImplementedError("the zmq transfer backend moves CPU caches only; use nixl for CUDA")
        self._regions[region] = region_bytes(tensor)
        if region == "kv" and self._router is not None:
            # No frame may be larger than the whole cache: ZeroMQ drops such a connection itself.
            self._router.setsockopt(zmq.MAXMSGSIZE, max(1 << 20, len(self._regions[region])))

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode({"name": self.name, "endpoint": self.endpoint})

    def metadata_for(self, peer: str) -> bytes:
        return msgspec.msgpack.encode(
            {"name": self.name, "endpoint": self.endpoint, "identity": self._identity_of.get(peer, b"")}
        )

    def set_write_limit(self, limit) -> None:
        self._write_limit = limit

    def connect(self, peer: str, metadata: bytes) -> None:
        meta = msgspec.msgpack.decode(metadata)
        if not isinstance(meta, dict) or meta.get("name") != peer:
            raise ValueError(f"metadata is not for {peer!r}")
        self.disconnect(peer)
        if not meta.get("endpoint"):
            # A sender: we answer it through our ROUTER, by the identity we assign it now.
            self._peer_of.pop(self._identity_of.pop(peer, b""), None)
            identity = secrets.token_hex(16).encode()  # never starts with a zero byte (reserved by ZeroMQ)
            self._identity_of[peer], self._peer_of[identity] = identity, peer
            self._met_at[peer] = time.monotonic()
            self._routed.discard(peer)
            return
        identity = meta.get("identity")
        if not isinstance(identity, bytes) or not identity:
            raise ValueError(f"{peer!r} assigned us no connection identity")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 64)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(meta["endpoint"])
        self._peers[peer] = _Peer(sock, monitor)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def peer_connected(self, peer: str) -> bool:
        """An empty frame to its identity: with ``ROUTER_MANDATORY`` the ROUTER refuses it
        (EHOSTUNREACH) once that connection is gone. Senders ignore frames they cannot decode.
        A sender met less than ``connect_timeout_s`` ago whose connection the ROUTER never had
        yet counts as connected: it connects right after the handshake, asynchronously."""
        identity = self._identity_of.get(peer)
        if self._router is None or identity is None:
            return False
        try:
            self._router.send_multipart([identity, b""], flags=zmq.NOBLOCK)
        except zmq.Again:  # connected, its queue full
            return True
        except zmq.ZMQError:
            connecting = peer not in self._routed and time.monotonic() - self._met_at.get(peer, 0.0) < self._timeout
            return connecting
        self._routed.add(peer)
        return True

    def _enqueue(self, peer: str, frames: list) -> None:
        state = self._peers.get(peer)
        if state is None:
            raise TransferError(f"not connected to {peer!r}")
        if state.failed:
            raise TransferError(state.failed)
        state.outbox.append((frames, time.monotonic() + self._timeout))
        self._flush(state)

    def _flush(self, state: _Peer) -> None:
        while state.outbox and not state.failed:
            frames, give_up = state.outbox[0]
            try:
                state.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if time.monotonic() > give_up:
                    state.failed = f"peer unreachable for {self._timeout:.1f} s"
                return
            except zmq.ZMQError as exc:  # e.g. the socket was closed by a reconnect
                state.failed = f"send failed: {exc}"
                return
            state.outbox.popleft()

    def write(self, peer, transfer_id, layer, region, src_offsets, dst_offsets, lengths):
        src_offsets = np.ascontiguousarray(src_offsets, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        data = (
            gather(self._regions[region], src_offsets, lengths)
            if len(lengths) != 1
            else self._regions[region].numpy()[src_offsets[0] : src_offsets[0] + lengths[0]]
        )
        header = encode(WriteHeader(transfer_id, layer, len(lengths), int(lengths.sum())))
        frames = [header, np.ascontiguousarray(dst_offsets, dtype=np.int64).tobytes(), lengths.tobytes(), data]
        self._enqueue(peer, frames)
        return self._peers[peer]

    def write_done(self, handle: _Peer) -> bool:
        self._flush(handle)
        if handle.failed:
            raise TransferError(handle.failed)
        return not handle.outbox

    def send_notice(self, peer: str, payload: bytes) -> None:
        if peer in self._peers:
            self._enqueue(peer, [payload])
            return
        if self._router is None:
            raise TransferError(f"not connected to {peer!r}")
        identity = self._identity_of.get(peer)
        if identity is None:
            raise TransferError(f"not connected to {peer!r}")
        try:
            self._router.send_multipart([identity, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that sender is gone
            raise TransferError(f"cannot reach {peer!r}: {exc}") from exc

    def poll(self, timeout_s: float = 0.0):
        out: list = []
        for state in self._peers.values():
            self._flush(state)
        ready = dict(self._poller.poll(timeout_s * 1000.0))
        for peer, state in list(self._peers.items()):
            if state.monitor in ready:
                recv_monitor_message(state.monitor)
                state.failed = state.failed or f"connection to {peer!r} dropped"
                out.append(PeerLost(peer))
            while state.sock in ready and state.sock.poll(0):
                out.append(NoticeIn(peer, state.sock.recv()))
                self._discard_rest(state.sock)
        if self._router in ready:
            out.extend(self._recv_router())
        return out

    def _recv_router(self) -> list:
        """Notices until the first write (its payload lives in the staging buffer)."""
        out: list = []
        while self._router.poll(0):
            identity = self._router.recv()
            peer = self._peer_of.get(identity)
            if peer is None or not self._router.getsockopt(zmq.RCVMORE):
                self._discard_rest(self._router)
                out.append(Dropped(peer or identity.hex()[:64], "unbound_identity" if peer is None else "malformed"))
                continue
            self._routed.add(peer)  # it has connected (peer_connected)
            head = self._router.recv()
            if not self._router.getsockopt(zmq.RCVMORE):
                out.append(NoticeIn(peer, head))
                continue
            item = self._recv_write(peer, head)
            out.append(item)
            if isinstance(item, WriteIn):
                return out
        return out

    def _recv_write(self, peer: str, head: bytes) -> WriteIn | Dropped:
        """One write, its sizes checked before its payload is allocated or read."""
        msg = self._header(head)
        if msg is None:
            self._discard_rest(self._router)
            return Dropped(peer, "malformed")
        limit = self._write_limit(msg.transfer_id)
        if limit is None:
            self._discard_rest(self._router)
            return Dropped(peer, "unknown_transfer", msg.transfer_id)
        if msg.nbytes > limit or msg.num_ranges > MAX_RANGES:
            self._discard_rest(self._router)
            return Dropped(peer, "oversized", msg.transfer_id)
        offsets = self._int64_frame(msg.num_ranges)
        lengths = self._int64_frame(msg.num_ranges) if offsets is not None else None
        region = len(self._regions["kv"]) if "kv" in self._regions else 0
        # Bounded first, so that neither the sum nor offset + length can overflow int64.
        if (
            lengths is None
            or not self._router.getsockopt(zmq.RCVMORE)
            or (offsets < 0).any()
            or (offsets > region).any()
            or (lengths < 0).any()
            or (lengths > msg.nbytes).any()
            or int(lengths.sum()) != msg.nbytes
        ):
            self._discard_rest(self._router)
            return Dropped(peer, "malformed", msg.transfer_id)
        if len(self._staging) < msg.nbytes:
            self._staging = np.empty(msg.nbytes, dtype=np.uint8)  # at most one reservation's layer
        staged = self._staging[: msg.nbytes]
        got = self._router.recv_into(staged) if msg.nbytes else len(self._router.recv())
        more = self._router.getsockopt(zmq.RCVMORE)
        self._discard_rest(self._router)
        if got != msg.nbytes or more:  # a longer frame is truncated by recv_into: got says so
            return Dropped(peer, "malformed", msg.transfer_id)
        return WriteIn(peer, msg.transfer_id, msg.layer, offsets, lengths, staged)

    @staticmethod
    def _header(head: bytes) -> WriteHeader | None:
        try:
            msg = decode(head)
        except msgspec.DecodeError:
            return None
        if (
            not isinstance(msg, WriteHeader)
            or msg.nbytes < 0
            or msg.num_ranges < 0
            or msg.layer < 0
            or not msg.transfer_id
        ):
            return None
        return msg

    def _int64_frame(self, count: int) -> np.ndarray | None:
        """The next frame as ``count`` int64s, or None (missing, or another size)."""
        if not self._router.getsockopt(zmq.RCVMORE):
            return None
        frame = self._router.recv(copy=False)
        if len(frame.buffer) != 8 * count:
            return None
        return np.frombuffer(frame.buffer, dtype=np.int64).copy()

    @staticmethod
    def _discard_rest(sock) -> None:
        while sock.getsockopt(zmq.RCVMORE):
            sock.recv()

    def apply(self, write: WriteIn) -> None:
        scatter(self._regions["kv"], write.dst_offsets, write.lengths, write.data)

    def disconnect(self, peer: str) -> None:
        state = self._peers.pop(peer, None)
        if state is None:
            return
        state.failed = state.failed or f"disconnected from {peer!r}"  # handles still held fail cleanly
        for sock in (state.sock, state.monitor):
            self._poller.unregister(sock)
        state.sock.disable_monitor()
        state.monitor.close(linger=0)
        state.sock.close(linger=0)

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()
