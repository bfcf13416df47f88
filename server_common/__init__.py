"""Parts shared by the prefill and decode servers (and the router's view of them).

``worker_requests`` (router -> server) and ``worker_replies`` (server ->
router) are the internal control plane's JSON messages, one module per
direction; they import nothing heavy, so the router can use them without
torch. ``engine_thread`` and ``metrics`` are the server-side plumbing both
servers run.
"""
