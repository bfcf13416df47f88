"""The transfer layer: prefill writes KV straight into blocks a decode server
reserved, layer by layer (see docs/architecture.md and transfer/README.md).

Two halves: pure planning (``layout``, ``plan``, ``tp``: which byte ranges go
where) and byte movers behind one interface (``backend``: NIXL, ZeroMQ,
in-process), so the planning is tested without a network and a new backend
plans nothing. ``KVSender`` and ``KVReceiver`` are what ``kvlink`` calls
(one per rank of a server); each owns one transfer thread that owns its
backend.

Decode server::

    receiver = KVReceiver(make_backend(cfg.backend, name, **opts), engine.cache.kv,
                          KVLayout.for_engine_cache(...), name=name, model=model_id,
                          notify=engine_thread.wake)
    receiver.start()
    reply = receiver.accept(prefill_hello)          # control plane, once per prefill
    blocks = engine.reserve(rid, prompt, sampling)
    tid = receiver.expect(blocks, lease_s)          # goes into the reservation
    ...between two engine steps:
    for ended in receiver.take_finished():          # TransferEnded(tid, outcome, reason, first_tokens)
        ended.ok -> engine.admit_remote(rid_of[tid], list(ended.first_tokens))
        else     -> engine.abort(rid_of[tid])       # blocks free only now
    receiver.cancel(tid)                            # client gone: wait for take_finished()

Prefill server::

    sender = KVSender(make_backend(...), engine.cache.kv, layout, name=name, model=model_id,
                      notify=engine_thread.wake)
    sender.start()
    peer = sender.connect(reply)                    # decode's accept() answer
    sender.begin(tid, peer, dst_blocks, lease_s)    # from the reservation
    layer_hook: sender.push_layer(tid, layer, chunk.block_ids, chunk.start, chunk.end)
    prefilled:  sender.finish(tid, first_tokens)
    between two engine steps: sender.take_finished(), ok or not -> engine.release(rid)

Outcomes are ``transfer.outcome.Outcome`` codes, used unchanged by the servers
and the router. This package imports nothing at import time: the router takes
``transfer.outcome`` without torch; import the module you need
(``transfer.receiver``, ``transfer.sender``, ``transfer.layout``, ...).
"""
