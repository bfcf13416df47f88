"""In-process backend: both sides in one process, messages through queues.

It behaves like the ZeroMQ backend (the receiver applies writes itself after
checking them), so server tests exercise the same receiver logic without
sockets. Sides find each other through an ``InprocHub`` the test creates and
hands to both (no module-level registry).
"""

from __future__ import annotations

import queue
import threading

import msgspec
import numpy as np

from transfer.backend import Backend, NoticeIn, PeerLost, TransferError, WriteIn
from transfer.copy import gather, region_bytes, scatter


class InprocHub:
    """Mailboxes of the in-process backends that can reach each other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict[str, queue.Queue] = {}

    def open(self, name: str) -> queue.Queue:
        with self._lock:
            if name in self._boxes:
                raise ValueError(f"in-process backend name {name!r} is already used")
            self._boxes[name] = queue.Queue()
            return self._boxes[name]

    def close(self, name: str) -> None:
        with self._lock:
            self._boxes.pop(name, None)
            others = list(self._boxes.values())
        for box in others:
            box.put(PeerLost(name))

    def box(self, name: str) -> queue.Queue:
        with self._lock:
            box = self._boxes.get(name)
        if box is None:
            raise TransferError(f"in-process peer {name!r} is gone")
        return box


class InprocBackend(Backend):
    kind = "inproc"
    one_sided = False

    def __init__(self, name: str, hub: InprocHub) -> None:
        self.name = name
        self._hub = hub
        self._inbox = hub.open(name)
        self._regions: dict[str, object] = {}
        self._peers: set[str] = set()

    def register(self, region: str, tensor) -> None:
        self._regions[region] = region_bytes(tensor)

    def metadata(self) -> bytes:
        return msgspec.msgpack.encode({"name": self.name})

    def connect(self, peer: str, metadata: bytes) -> None:
        meta = msgspec.msgpack.decode(metadata)
        if meta["name"] != peer:
            raise ValueError(f"metadata is for {meta['name']!r}, not {peer!r}")
        self._peers.add(peer)

    def write(self, peer, transfer_id, layer, region, src_offsets, dst_offsets, lengths):
        if peer not in self._peers:
            raise TransferError(f"not connected to {peer!r}")
        data = gather(self._regions[region], src_offsets, lengths)
        self._hub.box(peer).put(
            WriteIn(
                self.name,
                transfer_id,
                layer,
                np.array(dst_offsets, dtype=np.int64),
                np.array(lengths, dtype=np.int64),
                data,
            )
        )
        return True

    def write_done(self, handle) -> bool:
        return True

    def send_notice(self, peer: str, payload: bytes) -> None:
        self._hub.box(peer).put(NoticeIn(self.name, payload))

    def poll(self, timeout_s: float = 0.0):
        out = []
        try:
            out.append(self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def apply(self, write: WriteIn) -> None:
        scatter(self._regions["kv"], write.dst_offsets, write.lengths, write.data)

    def disconnect(self, peer: str) -> None:
        self._peers.discard(peer)

    def close(self) -> None:
        self._hub.close(self.name)
        self._peers.clear()
