"""One frozen settings object per prefill/decode server process.

deploy/config.py builds it from the cluster YAML; the defaults and ``Literal``
types written here are the only copy (the config takes them from here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.config import EngineConfig, EngineMode
from server_common.process_defaults import DRAIN_TIMEOUT_S, LOOPBACK_HOST, DrainMode
from server_common.timeline_log import TimelineLog
from server_common.tracing import TracingSettings

TransferBackendName = Literal["zmq", "nixl"]  # transfer's in-process backend is for tests inside one process
KvFailureAction = Literal["fail", "local"]  # a lease expired or a checksum failed: fail it, or prefill it on D


@dataclass(frozen=True)
class ServerSettings:
    """``role`` is prefill, decode or colocated (a decode server that never
    receives remote KV). ``kv_port`` is the transfer backend's listening port
    on a decode server."""

    name: str
    role: EngineMode
    engine: EngineConfig
    host: str = LOOPBACK_HOST  # the address others reach it at (advertised in reservations and handshakes)
    bind_host: str | None = None  # the address it binds (None: host; 0.0.0.0: every interface)
    port: int = 8200
    kv_port: int = 8201
    transfer_backend: TransferBackendName = "zmq"
    lease_s: float = 30.0
    transfer_timeout_s: float = 10.0
    lease_expiry: KvFailureAction = "fail"
    checksum_failure: KvFailureAction = "fail"
    # A prefill server reads the whole blocks of a reservation's cached prefix its own cache lacks from the
    # decode server instead of computing them (decode-to-prefill reuse, kvlink/prefix_read.py). On by
    # default: a prompt with nothing to read costs a comparison, or hashing D's cached prefix (docs/kv-tiers.md,
    # "Decode-to-prefill reuse without a store").
    pull_prefix: bool = True
    # ... and only when computing those tokens is estimated to take at least this many times as long as
    # reading them (prefill_server/pull_rule.py); 0 reads whenever the decode server holds more.
    pull_prefix_margin: float = 1.0
    fault_injection: bool = False  # mount /admin/faults (tests only)
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    drain: DrainMode = "migrate"  # a decode server told to drain (SIGTERM, POST /admin/drain): see DrainMode
    # Slow and greedy clients (server_common/connections.py): a request's headers within header_timeout_s,
    # its body within body_timeout_s after them, at most max_connections_per_client open from one address
    # (the router's pool to one worker, worker_connections, stays under it).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections_per_client: int = 2048
    # Open connections in all; the last reserved_connections for loopback and trusted_clients (the hosts of
    # the cluster's router and servers), so that strangers' connections never lock the router out.
    max_connections: int = 4096
    reserved_connections: int = 64
    trusted_clients: tuple[str, ...] = ()
    internal_secret: str | None = field(default=None, repr=False)  # required on internal calls; never logged
    # (name, url) of the cluster's decode servers: a prefill server's handshakes go there only
    decode_peers: tuple[tuple[str, str], ...] = ()
    max_unfilled_blocks_per_caller: int | None = None  # server_common.quota (None: only the cache bounds it)
    max_body_bytes: int = 16 << 20  # larger bodies get 413 before they are read (a 1M-token prompt fits)
    log_stats_interval_s: float = 10.0  # a stats line this often while there is traffic (0: none; stats_log.py)
    stuck_after_s: float = 60.0  # /health: a thread with work that made no progress this long is stuck
    timeline_entries: int = TimelineLog.CAPACITY  # the latest requests GET /debug/timeline keeps
    launch_id: str | None = None  # reported in /health; from `pdserve launch` (deploy/process_cli.py)
    tracing: TracingSettings = field(default_factory=TracingSettings)  # off unless an endpoint is set

    @property
    def listen_host(self) -> str:
        """The address it binds (``bind_host``; by default the one others reach it at, ``host``)."""
        return self.bind_host or self.host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
