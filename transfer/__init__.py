"""The transfer layer: prefill writes KV straight into blocks a decode server
reserved, layer by layer (see ../shared/DESIGN.md and transfer/README.md).

Two halves (STYLE 5): pure planning (``layout``, ``plan``: which byte ranges go
where) and byte movers behind one interface (``backend``: NIXL, ZeroMQ,
in-process). ``KVSender`` and ``KVReceiver`` are what the servers call; each
owns one transfer thread that owns its backend.

Decode server::

    receiver = KVReceiver(make_backend(cfg.backend, name, **opts), engine.cache.kv,
                          KVLayout.for_engine_cache(...), name=name, model=model_id)
    reply = receiver.accept(prefill_hello)          # control plane, once per prefill
    blocks = engine.reserve(rid, prompt, sampling)
    tid = receiver.expect(blocks, lease_s)          # goes into the reservation
    ...each engine-loop turn:
    ev = receiver.poll()
    ev.completed -> engine.admit_remote(rid_of[tid], c.first_token)
    ev.failed    -> engine.abort(rid_of[tid])       # blocks free only now
    receiver.cancel(tid)                            # client gone: wait for poll()

Prefill server::

    sender = KVSender(make_backend(...), engine.cache.kv, layout, name=name, model=model_id)
    peer = sender.connect(reply)                    # decode's accept() answer
    sender.begin(tid, peer, dst_blocks, lease_s)    # from the reservation
    layer_hook: sender.push_layer(tid, layer, chunk.block_ids, chunk.start, chunk.end)
    prefilled:  sender.finish(tid, first_token)
    ev = sender.poll(); completed or failed -> engine.release(rid)
"""

from transfer.backend import BACKENDS, Backend, TransferError, make_backend
from transfer.layout import IncompatiblePeer, KVLayout, heads_for_rank
from transfer.plan import CopyPlan, make_plan, staging_layout
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.session import Completed, Events, Failed

__all__ = [
    "BACKENDS", "Backend", "Completed", "CopyPlan", "Events", "Failed", "IncompatiblePeer", "KVLayout",
    "KVReceiver", "KVSender", "TransferError", "heads_for_rank", "make_backend", "make_plan",
    "staging_layout",
]
