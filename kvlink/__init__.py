"""The KV link: everything a server does with KV beyond its own engine.

``ports`` is what the servers call (a decode server's receiver; a prefill
server's sender and its decode peers) and ``factory`` builds it from a
server's settings; the servers import nothing else of this package, and of
``transfer`` only its outcomes. Below the ports: ``ranks`` puts a server's
tensor-parallel ranks behind them as one group at every TP size (a server
without ranks is a group of one), ``agent`` is what runs in each other rank's
process, driven with ``messages``; ``peers`` is a prefill server's handshake
with its decode servers; ``faulty_backend`` injects faults on the wire for
the tests.

    prefill server ─ ports ─ ranks.RankSenders ── transfer.KVSender (rank 0)
                          │                    └─ agent in rank r: transfer.KVSender
                          └─ peers.DecodePeers ── POST /kv/hello on the decode server
    decode server  ─ ports ─ ranks.RankReceivers ─ transfer.KVReceiver (rank 0), agents
"""
