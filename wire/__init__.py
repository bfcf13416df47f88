"""The internal control plane's schemas, router <-> prefill/decode servers.

``requests`` (router -> server) and ``replies`` (server -> router: JSON
replies and the decode stream's events) are one module per direction;
``names`` holds what both ends check a name against, and ``kv_target`` the
one field of a reservation that the KV link reads (where to write). They
import nothing heavy (no torch, no HTTP stack), so the router uses them as
the servers do. A change here is a change of the wire: both ends move
together.
"""
