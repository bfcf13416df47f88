"""In-process sender/receiver pairs for the fast tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from transfer.factory import make_backend
from transfer.inproc import InprocHub
from transfer.layout import KVLayout
from transfer.outcome import TransferEnded
from transfer.receiver import KVReceiver
from transfer.sender import KVSender


def backend_options(kind: str, hub: InprocHub | None, role: str) -> dict:
    """Loopback settings for tests: a free port for zmq receivers, lo for UCX."""
    if kind == "inproc":
        return {"hub": hub}
    if kind == "zmq":
        return {"endpoint": "tcp://127.0.0.1:0"} if role == "recv" else {}
    return {"ucx_net_devices": "lo"}


def make_sender(kind, hub, name, layout: KVLayout, cache=None, **kw) -> KVSender:
    if cache is None:
        cache = torch.randn(layout.shape).to(getattr(torch, layout.dtype))
    sender = KVSender(
        make_backend(kind, name, **backend_options(kind, hub, "send")),
        cache,
        layout,
        name=name,
        model=kw.pop("model", "m"),
        **kw,
    )
    sender.start()
    return sender


def make_receiver(kind, hub, name, layout: KVLayout, **kw) -> KVReceiver:
    cache = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
    receiver = KVReceiver(
        make_backend(kind, name, **backend_options(kind, hub, "recv")),
        cache,
        layout,
        name=name,
        model=kw.pop("model", "m"),
        **kw,
    )
    receiver.start()
    return receiver


def meet(sender: KVSender, receiver: KVReceiver) -> str:
    return sender.connect(receiver.accept(sender.hello()))


@dataclass
class Ended:
    """Transfers a side reported ended, split by outcome."""

    ended: list[TransferEnded] = field(default_factory=list)

    @property
    def completed(self) -> list[TransferEnded]:
        return [e for e in self.ended if e.ok]

    @property
    def failed(self) -> list[TransferEnded]:
        return [e for e in self.ended if not e.ok]


def wait_events(side, timeout_s: float = 10.0, count: int = 1) -> Ended:
    """Take ended transfers until ``count`` of them arrived (or the deadline)."""
    got = Ended()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(got.ended) < count:
        got.ended += side.take_finished()
        time.sleep(0.002)
    return got


def push_all(
    sender: KVSender, tid: str, layout: KVLayout, src_blocks, start, end, first_tokens=(1,), finish=True
) -> None:
    for layer in range(layout.num_layers):
        sender.push_layer(tid, layer, src_blocks, start, end)
    if finish:
        sender.finish(tid, first_tokens)
