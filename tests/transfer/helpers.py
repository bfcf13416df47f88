"""In-process sender/receiver pairs for the fast tests."""

from __future__ import annotations

import time

import torch

from transfer.backend import make_backend
from transfer.inproc import InprocHub
from transfer.layout import KVLayout
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.session import Events


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
    return KVSender(make_backend(kind, name, **backend_options(kind, hub, "send")), cache, layout,
                    name=name, model=kw.pop("model", "m"), **kw)


def make_receiver(kind, hub, name, layout: KVLayout, **kw) -> KVReceiver:
    cache = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
    return KVReceiver(make_backend(kind, name, **backend_options(kind, hub, "recv")), cache, layout,
                      name=name, model=kw.pop("model", "m"), **kw)


def meet(sender: KVSender, receiver: KVReceiver) -> str:
    return sender.connect(receiver.accept(sender.hello()))


def wait_events(side, timeout_s: float = 10.0, count: int = 1) -> Events:
    """Poll until ``count`` transfers ended (or the timeout)."""
    got = Events()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(got.completed) + len(got.failed) < count:
        ev = side.poll()
        got.completed += ev.completed
        got.failed += ev.failed
        time.sleep(0.002)
    return got


def push_all(sender: KVSender, tid: str, layout: KVLayout, src_blocks, start, end, first_token=1,
             finish=True) -> None:
    for layer in range(layout.num_layers):
        sender.push_layer(tid, layer, src_blocks, start, end)
    if finish:
        sender.finish(tid, first_token)
