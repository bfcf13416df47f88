"""A transfer backend wrapper that injects faults "on the wire" (tests only).

It sits between KVSender/KVReceiver and the real backend, so the transfer
layer itself runs unchanged: the sender believes a dropped notice was sent
(and waits for an Ack that never comes), a delayed notice is handed to the
real backend ``notice_delay_s`` later, whatever became of its transfer
meanwhile (as a slow network would), and a corrupted write reaches the
receiver's checks with one byte flipped. Corruption needs a message backend
(ZeroMQ, in-process), where the receiver sees each write before applying it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from server_common.faults import FaultInjector
from transfer.backend import Backend, Dropped, NoticeIn, PeerLost, TransferError, WriteIn
from transfer.messages import Done, decode

log = logging.getLogger(__name__)


class FaultyBackend(Backend):
    def __init__(self, inner: Backend, faults: FaultInjector) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.one_sided = inner.one_sided
        self._faults = faults
        self._delayed: deque[tuple[float, str, bytes]] = deque()  # (due, peer, payload); transfer thread only

    def __getattr__(self, name: str) -> Any:  # backend-specific extras (e.g. zmq's endpoint)
        return getattr(self.inner, name)

    # ---- the faults ------------------------------------------------------------------
    def send_notice(self, peer: str, payload: bytes) -> None:
        if _is_done(payload):
            if self._faults.take("drop_notices"):
                log.warning("fault injection: dropped the completion notice to %s", peer)
                return
            if self._faults.take("delay_notices"):
                log.warning("fault injection: delaying the completion notice to %s", peer)
                self._delayed.append((time.monotonic() + self._faults.notice_delay_s, peer, payload))
                return
        self.inner.send_notice(peer, payload)

    def poll(self, timeout_s: float = 0.0) -> list[NoticeIn | WriteIn | PeerLost | Dropped]:
        if self._faults.take("break_transport"):
            raise RuntimeError("fault injection: the transport broke")
        while self._delayed and self._delayed[0][0] <= time.monotonic():
            _, peer, payload = self._delayed.popleft()
            try:
                self.inner.send_notice(peer, payload)
            except TransferError as exc:
                log.info("fault injection: late notice to %s not sent: %s", peer, exc)
        items = self.inner.poll(timeout_s)
        for item in items:
            if isinstance(item, WriteIn) and item.lengths.sum() > 0 and self._faults.take("corrupt_writes"):
                log.warning("fault injection: corrupting a write of transfer %s", item.transfer_id)
                data = np.asarray(item.data).reshape(-1).view(np.uint8)
                data[0] ^= 0xFF
        return items

    # ---- plain delegation --------------------------------------------------------------
    def register(self, region: str, tensor: Any) -> None:
        self.inner.register(region, tensor)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def metadata_for(self, peer: str) -> bytes:
        return self.inner.metadata_for(peer)

    def set_write_limit(self, limit: Any) -> None:
        self.inner.set_write_limit(limit)

    def peer_connected(self, peer: str) -> bool:
        return self.inner.peer_connected(peer)

    def connect(self, peer: str, metadata: bytes) -> None:
        self.inner.connect(peer, metadata)

    def prepare(self, peer: str, region: str, chunk_bytes: int) -> None:
        self.inner.prepare(peer, region, chunk_bytes)

    def write(
        self,
        peer: str,
        transfer_id: str,
        layer: int,
        region: str,
        src_offsets: np.ndarray,
        dst_offsets: np.ndarray,
        lengths: np.ndarray,
    ) -> Any:
        return self.inner.write(peer, transfer_id, layer, region, src_offsets, dst_offsets, lengths)

    def write_done(self, handle: Any) -> bool:
        return self.inner.write_done(handle)

    def apply(self, write: WriteIn) -> None:
        self.inner.apply(write)

    def disconnect(self, peer: str) -> None:
        self.inner.disconnect(peer)

    def close(self) -> None:
        self.inner.close()


def _is_done(payload: bytes) -> bool:
    try:
        return isinstance(decode(payload), Done)
    except msgspec.DecodeError:
        return False
