"""A prefill or decode server's tensor-parallel rank: ``python -m kvlink.agent``.

The rank runs engine/tp_worker.py's loop with an agent: a ``KVSender``
(prefill) or a ``KVReceiver`` (decode) over its own slice of the KV cache
(its KV heads, every block), under its own agent name (``<server>-r<rank>``).
Rank 0 (``kvlink.ranks``) drives it with ``kvlink.messages`` down the rank's
pipe, between steps and in order with them; the agent answers the ones that
ask and reports every part its sender or receiver saw end (``PartEnded``).
"""

from __future__ import annotations

import sys
import threading
import time

from engine import tp_worker
from engine.kv_cache import KVCache
from kvlink.factory import cache_layout
from kvlink.messages import (
    Abort,
    Accept,
    Answer,
    AskHello,
    Begin,
    CancelPart,
    Connect,
    Expect,
    Finish,
    Forget,
    Open,
    PartEnded,
    Push,
    ToRank,
    to_pipe,
    to_rank,
)
from transfer.layout import KVLayout
from transfer.receiver import KVReceiver
from transfer.sender import KVSender


class RankAgent:
    def __init__(self, spec: dict, cache: KVCache, reply: tp_worker.Reply) -> None:
        self._cache = cache
        self._reply = reply
        self._sender: KVSender | None = None
        self._receiver: KVReceiver | None = None
        self._ended = threading.Event()

    def __call__(self, raw: dict) -> None:
        message = to_rank(raw)
        if isinstance(message, Open | AskHello | Connect | Accept | Expect):
            try:
                answer = self._answer(message)
            except Exception as exc:  # noqa: BLE001 - rank 0 raises it to its caller
                answer = Answer(message.id, error=f"{type(exc).__name__}: {exc}")
            self._reply(to_pipe(answer))
        else:
            self._act(message)

    def _answer(self, m: Open | AskHello | Connect | Accept | Expect) -> Answer:
        if isinstance(m, Open):
            return Answer(m.id, layout=self._open(m))
        if isinstance(m, AskHello):
            return Answer(m.id, hello=self._agent().hello())
        if isinstance(m, Connect):
            return Answer(m.id, peer=self._agent_sender().connect(m.hello, m.timeout_s))
        if isinstance(m, Accept):
            return Answer(m.id, hello=self._agent_receiver().accept(m.hello, m.timeout_s))
        return Answer(m.id, tid=self._agent_receiver().expect(m.blocks, m.lease_s, writable_from=m.writable_from))

    def _act(self, m: ToRank) -> None:
        if isinstance(m, CancelPart):
            self._agent_receiver().cancel(m.tid, m.reason)
            return
        sender = self._agent_sender()
        if isinstance(m, Begin):
            sender.begin(m.tid, m.peer, m.blocks, max(m.deadline - time.monotonic(), 1e-3), m.heads)
        elif isinstance(m, Push):
            sender.push_layer(m.tid, m.layer, m.blocks, m.start, m.end)
        elif isinstance(m, Finish):
            sender.finish(m.tid, m.first_tokens)
        elif isinstance(m, Abort):
            sender.abort(m.tid)
        elif isinstance(m, Forget):
            sender.forget(m.peer)
        else:
            raise RuntimeError(f"message {type(m).__name__} needs an answer")

    def _agent(self) -> KVSender | KVReceiver:
        agent = self._sender or self._receiver
        if agent is None:
            raise RuntimeError("a message before the agent was opened")
        return agent

    def _agent_sender(self) -> KVSender:
        if self._sender is None:
            raise RuntimeError("a sender's message to a rank that holds no sender")
        return self._sender

    def _agent_receiver(self) -> KVReceiver:
        if self._receiver is None:
            raise RuntimeError("a receiver's message to a rank that holds no receiver")
        return self._receiver

    def _open(self, m: Open) -> KVLayout:
        from transfer.factory import make_backend

        receiving = m.role == "decode"
        if m.backend == "zmq":
            backend = make_backend(
                "zmq",
                m.name,
                endpoint=f"tcp://{m.host or '127.0.0.1'}:0" if receiving else None,
                connect_timeout_s=m.timeout_s,
                advertise_host=(m.advertise or None) if receiving else None,
            )
        else:
            backend = make_backend(m.backend, m.name)
        layout = cache_layout(self._cache)
        agent: KVSender | KVReceiver
        if receiving:
            agent = self._receiver = KVReceiver(
                backend, self._cache.kv, layout, name=m.name, model=m.model, notify=self._ended.set
            )
        else:
            agent = self._sender = KVSender(
                backend, self._cache.kv, layout, name=m.name, model=m.model, notify=self._ended.set
            )
        agent.start()
        threading.Thread(target=self._forward_ended, name="tp-rank-ended", daemon=True).start()
        return layout

    def _forward_ended(self) -> None:
        """Every part the sender or receiver saw end, to rank 0."""
        agent = self._agent()
        while True:
            self._ended.wait()
            self._ended.clear()
            for e in agent.take_finished():
                self._reply(to_pipe(PartEnded(e.transfer_id, str(e.outcome), e.reason, e.first_tokens, e.at)))


def main() -> int:
    return tp_worker.main(RankAgent)


if __name__ == "__main__":
    sys.exit(main())
