"""A prefill or decode server's tensor-parallel rank: ``python -m server_common.tp_rank``.

The rank runs engine/tp_worker.py's loop with an agent: a ``KVSender`` (prefill)
or a ``KVReceiver`` (decode) over its own slice of the KV cache (its KV heads,
every block), under its own agent name (``<server>-r<rank>``). Rank 0 (the
server process, ``server_common.tp_transfer.RankSenders`` or
``server_common.tp_transfer.RankReceivers``) drives it with messages down the
rank's pipe, between steps and in order with them:

    open      {role, backend, name, model, timeout_s, host}   build and start it (host: a ZeroMQ
                                                  receiver binds a port the system picks there)
    hello     {id}                 -> {id, hello}  its handshake message (base64)
    connect   {id, hello}          -> {id, peer} | {id, error}         (sender)
    accept    {id, hello}          -> {id, hello} | {id, error}        (receiver)
    expect    {id, blocks, lease_s, writable_from} -> {id, tid} | {id, error}   (receiver)
    cancel    {tid, reason}                                           (receiver)
    begin     {tid, peer, blocks, deadline, heads} (deadline: time.monotonic() on this host)
    push      {tid, blocks, start, end}  every layer of tokens [start, end): sent after the step
                                         that computed them, so this rank's forward has written them
    finish    {tid, first}
    abort     {tid}
    forget    {peer}

and the agent answers ``{ended: [tid, outcome, reason, first_tokens, at]}``
for every part its sender saw end.
"""

from __future__ import annotations

import base64
import sys
import threading
import time

from engine import tp_worker
from engine.kv_cache import KVCache
from server_common.kv_adapter import cache_layout


class RankAgent:
    def __init__(self, spec: dict, cache: KVCache, reply: tp_worker.Reply) -> None:
        self._cache = cache
        self._reply = reply
        self._sender = None
        self._receiver = None
        self._ended = threading.Event()

    def __call__(self, message: dict) -> None:
        op = message["op"]
        if op == "open":
            self._open(message)
            return
        if self._receiver is not None:
            self._receive(op, message)
            return
        sender = self._sender
        if sender is None:
            raise RuntimeError(f"message {op!r} before the sender was opened")
        if op == "hello":
            self._reply({"id": message["id"], "hello": base64.b64encode(sender.hello()).decode()})
        elif op == "connect":
            try:
                peer = sender.connect(base64.b64decode(message["hello"]), float(message["timeout_s"]))
            except Exception as exc:  # noqa: BLE001 - the leader raises it to its caller
                self._reply({"id": message["id"], "error": f"{type(exc).__name__}: {exc}"})
            else:
                self._reply({"id": message["id"], "peer": peer})
        elif op == "begin":
            lease_s = max(float(message["deadline"]) - time.monotonic(), 1e-3)
            sender.begin(message["tid"], message["peer"], message["blocks"], lease_s, message["heads"])
        elif op == "push":
            for layer in range(self._cache.num_layers):
                sender.push_layer(message["tid"], layer, message["blocks"], message["start"], message["end"])
        elif op == "finish":
            sender.finish(message["tid"], message["first"])
        elif op == "abort":
            sender.abort(message["tid"])
        elif op == "forget":
            sender.forget(message["peer"])
        else:
            raise RuntimeError(f"unknown message {op!r}")

    def _receive(self, op: str, message: dict) -> None:
        receiver = self._receiver
        assert receiver is not None
        if op == "hello":
            self._reply({"id": message["id"], "hello": base64.b64encode(receiver.hello()).decode()})
            return
        if op == "cancel":
            receiver.cancel(message["tid"], message["reason"])
            return
        try:
            if op == "accept":
                answer = receiver.accept(base64.b64decode(message["hello"]), float(message["timeout_s"]))
                out = {"hello": base64.b64encode(answer).decode()}
            elif op == "expect":
                lease_s = float(message["lease_s"])
                out = {"tid": receiver.expect(message["blocks"], lease_s, writable_from=message["writable_from"])}
            else:
                raise RuntimeError(f"unknown message {op!r}")
        except Exception as exc:  # noqa: BLE001 - the leader raises it to its caller
            self._reply({"id": message["id"], "error": f"{type(exc).__name__}: {exc}"})
        else:
            self._reply({"id": message["id"], **out})

    def _open(self, message: dict) -> None:
        from transfer.factory import make_backend
        from transfer.receiver import KVReceiver
        from transfer.sender import KVSender

        kind, name, receiving = message["backend"], message["name"], message.get("role") == "decode"
        if kind == "zmq":
            host = message.get("host") or "127.0.0.1"
            endpoint = f"tcp://{host}:0" if receiving else None
            backend = make_backend(
                "zmq",
                name,
                endpoint=endpoint,
                connect_timeout_s=float(message["timeout_s"]),
                advertise_host=message.get("advertise") if receiving else None,
            )
        else:
            backend = make_backend(kind, name)
        agent = (KVReceiver if receiving else KVSender)(
            backend,
            self._cache.kv,
            cache_layout(self._cache),
            name=name,
            model=message["model"],
            notify=self._ended.set,
        )
        if receiving:
            self._receiver = agent
        else:
            self._sender = agent
        agent.start()
        threading.Thread(target=self._forward_ended, name="tp-rank-ended", daemon=True).start()

    def _forward_ended(self) -> None:
        """Every part the sender or receiver saw end, to rank 0."""
        agent = self._sender or self._receiver
        assert agent is not None
        while True:
            self._ended.wait()
            self._ended.clear()
            for e in agent.take_finished():
                first = list(e.first_tokens) if e.first_tokens is not None else None
                self._reply({"ended": [e.transfer_id, str(e.outcome), e.reason, first, e.at]})


def main() -> int:
    return tp_worker.main(RankAgent)


if __name__ == "__main__":
    sys.exit(main())
