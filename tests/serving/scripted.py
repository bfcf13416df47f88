"""Scripted KV ports for in-process server tests: a test says when and how a
transfer ended (``end``); the server's engine thread takes it between two
steps, as it takes the real sender's and receiver's ended transfers."""

from __future__ import annotations

import threading

from transfer.outcome import Outcome, TransferEnded


class ScriptedEnds:
    def __init__(self, notify) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._ended: list[TransferEnded] = []

    def start(self) -> None:
        pass

    def end(self, tid: str, outcome: Outcome, reason: str = "", first_tokens: tuple[int, ...] | None = None) -> None:
        with self._lock:
            self._ended.append(TransferEnded(tid, outcome, reason, first_tokens))
        self._notify()

    def take_finished(self) -> list[TransferEnded]:
        with self._lock:
            out, self._ended = self._ended, []
        return out

    def problem(self, stuck_after_s: float) -> str | None:
        return None

    def close(self) -> None:
        pass


class ScriptedReceiver(ScriptedEnds):
    def __init__(self, notify) -> None:
        super().__init__(notify)
        self.expected: dict[str, list[int]] = {}
        self.writable_from: dict[str, int] = {}
        self.cancelled: list[str] = []

    def expect(self, block_ids, lease_s, writable_from=0) -> str:
        tid = f"t{len(self.expected)}"
        self.expected[tid] = list(block_ids)
        self.writable_from[tid] = writable_from
        return tid

    def target(self) -> dict:
        return {"peer": "d0", "hello_url": "http://d0/kv/hello"}

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)

    def counters(self) -> dict[str, int]:
        return {"dropped_expired": 2}


class ScriptedSender(ScriptedEnds):
    def __init__(self, notify) -> None:
        super().__init__(notify)
        self.calls: list[tuple] = []

    async def ensure_peer(self, target: dict) -> str:
        return target["peer"]

    def begin(self, tid, peer, dst_block_ids, lease_s) -> None:
        self.calls.append(("begin", tid, peer, list(dst_block_ids)))

    def push_layer(self, tid, layer, src_block_ids, start, end) -> None:
        self.calls.append(("push", tid, layer, start, end))

    def finish(self, tid, first_tokens) -> None:
        self.calls.append(("finish", tid, list(first_tokens)))

    def abort(self, tid) -> None:
        self.calls.append(("abort", tid))


def scripted(cls):
    """A port factory for a server that also keeps the one port it made: (factory, made)."""
    made: list = []

    def factory(notify):
        made.append(cls(notify))
        return made[-1]

    return factory, made
