"""The router's frozen settings (built from the cluster YAML by deploy/config.py).

Every router default and ``Literal`` type is written here once: the cluster
config takes its defaults from ``RouterSettings``, and so do the parts that
have settings of their own (``AdmissionSettings`` in router/cluster/admission.py,
``DispatchSettings`` in router/cluster/dispatch.py, ``WorkerRegistry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.request import DEFAULT_TENANT as DEFAULT_TENANT  # every API key no tenant lists (re-exported)
from engine.structured import GrammarLimits
from server_common.process_defaults import DRAIN_TIMEOUT_S, LOOPBACK_HOST, DrainMode
from server_common.tracing import TracingSettings

PolicyName = Literal["round_robin", "least_loaded", "cache_aware"]  # router/cluster/policies.py
PrefillFailure = Literal["retry", "local", "fail"]  # what a failed prefill leads to (router/cluster/recovery.py)
WorkerRole = Literal["prefill", "decode"]  # a colocated server is a decode server that prefills itself


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: WorkerRole
    url: str
    max_inflight: int | None = None  # requests this router sends it at once; None: no limit


DiscoveryKind = Literal["static", "dns"]


@dataclass(frozen=True)
class DiscoverySettings:
    """How workers join and leave at runtime (router/cluster/discovery.py). ``static``: the config's
    instances, plus what the admin API adds. ``dns``: every ``interval_s`` each ``HOST:PORT`` of
    ``names`` is re-resolved; every address that answers /health as a worker of this model joins,
    one that is gone is drained and forgotten."""

    kind: DiscoveryKind = "static"
    names: tuple[str, ...] = ()
    interval_s: float = 5.0
    # a discovered worker's in-flight limit (the config's per-worker limit; None: no limit)
    max_inflight: int | None = None


@dataclass(frozen=True)
class CompileSandbox:
    """The process the router compiles clients' grammars in (router/api/grammar_check.py)."""

    timeout_s: float = 5.0  # the longest one compile may take
    memory_bytes: int = 1 << 30  # its address space, at most


@dataclass(frozen=True)
class ResponseStoreSettings:
    """Where ``/v1/responses`` keeps stored responses (router/api/response_store/): a SQLite file, or
    ``:memory:`` (gone with the router); or, with ``url``, a PostgreSQL database several routers share.
    Rows live ``ttl_s`` and at most ``max_rows`` are kept. A background response keeps at most
    ``max_events`` events of at most ``max_event_bytes`` in all (router/api/background.py)."""

    path: str = ":memory:"
    ttl_s: float = 30 * 24 * 3600.0
    max_rows: int = 100_000
    max_events: int = 65_536
    max_event_bytes: int = 64 << 20
    # postgresql://user:password@host/db instead of path; it may hold a password, so no repr shows it.
    url: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.url is not None and self.path != ResponseStoreSettings.path:
            raise ValueError("a response store is a SQLite path or a PostgreSQL url, not both")


DEFAULT_CLASSES = ("interactive", "standard", "batch")  # priority classes, highest first


@dataclass(frozen=True)
class TenantSettings:
    name: str
    keys: tuple[str, ...] = field(default=(), repr=False)  # Bearer keys that are this tenant's
    weight: float = 1.0  # its share of the admitted work against the other tenants of its class
    priority: str | None = None  # its class (None: the middle one of ``priority_classes``)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


KvEventsMode = Literal["push", "poll"]


@dataclass(frozen=True)
class RouterSettings:
    model_path: str  # local Hugging Face folder (tokenizer, config, chat template)
    served_model_name: str
    workers: tuple[WorkerSpec, ...]
    host: str = LOOPBACK_HOST  # the address clients reach the router at
    bind_host: str | None = None  # the address it binds (None: host)
    port: int = 8000
    policy: PolicyName = "round_robin"
    local_prefill_threshold: int = 0  # prompts whose uncached part is shorter than this: prefilled on D
    cache_aware_load_weight: float = 1.0  # cache_aware policy: how much load counts against a cached prefix
    # How the servers' block-hash events reach the cache index (router/cluster/kv_events.py): pushed
    # through one stream per server, or polled every kv_events_interval_s.
    kv_events: KvEventsMode = "push"
    kv_events_interval_s: float = 0.2
    health_interval_s: float = 2.0  # seconds between health checks of a worker that answers
    # The longest a health check waits. Not tied to the interval: on a loaded machine an idle, live
    # worker's /health can take over a second, and a 1 s cap (the old max(1, interval)) took such
    # workers out of rotation right after the router's /health had said ok (router/cluster/registry.py).
    health_timeout_s: float = 5.0
    # A decode stream with no event (tokens or the server's heartbeat, every second) for this long has
    # failed: its server stopped. Such a server then leaves rotation (router/cluster/registry.py,
    # router/cluster/health.py).
    stream_stall_s: float = 15.0
    queue_timeout_s: float = 10.0  # the longest a request waits for a free slot before 429
    max_queued_requests: int = 128  # requests waiting for a slot; one more gets 429 at once
    retry_after_s: float = 1.0  # seconds, in the Retry-After of a 429
    prefill_timeout_s: float = 120.0
    max_model_len: int | None = None  # None: the model config's max_position_embeddings
    health_backoff_max_s: float = 8.0  # a down worker is polled at doubling intervals up to this
    worker_connections: int = 1024  # open HTTP connections to all workers together, at most
    worker_keepalive: int = 256  # idle connections kept open for reuse (beyond it, idle ones close)
    # How long an idle one stays open: below the servers' own keep-alive timeout (uvicorn's, 5 s), so the
    # router closes it first and never sends a request on a connection the server is closing.
    worker_keepalive_s: float = 2.0
    prefill_failure: PrefillFailure = "retry"
    migration_limit: int = 2  # decode failures one request survives, moved to another decode server each time
    # A decode server drained or removed through the admin API: its streams move to other decode servers
    # ("migrate") or finish there ("wait").
    drain: DrainMode = "migrate"
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # longer prompts get 400 (None: only the context length limits them)
    max_tokens: int | None = None  # larger max_tokens gets 400; a request without one gets at most this
    # The share of a decode server's KV cache one request may need at most: its prompt and n sequences of
    # max_tokens each (engine.request.kv_blocks_needed). More is a 400, or, for a request that did not set
    # max_tokens, a lower max_tokens; so no request can crowd out the rest or outgrow the cache.
    max_request_kv_share: float = 0.5
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # on SIGTERM: the longest to wait for requests in flight
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (server_common.connections)
    body_timeout_s: float = 30.0  # and its body within this after them
    max_connections_per_client: int = 256  # open connections from one address
    # How long a client's idle kept-alive connection stays open: longer than clients keep theirs (httpx and
    # the OpenAI SDKs 5 s, aiohttp 15 s), so a client never sends a request on a connection being closed.
    client_keepalive_s: float = 75.0
    access_log: bool = True  # one line per request (router/access_log.py)
    log_stats_interval_s: float = 10.0  # a stats line this often while there is traffic (0: none)
    max_connections: int = 8192  # open connections in all (and under the file-descriptor limit)
    reserved_connections: int = 64  # of those, kept for loopback callers (health checks on the host)
    # How large a grammar, schema, regex or choice list a request may send (engine/structured.py), and
    # the sandbox it is compiled in before any server sees it.
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    grammar_sandbox: CompileSandbox = field(default_factory=CompileSandbox)
    # Secrets stay out of repr, so a logged settings object shows none.
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: no auth (the tenants' keys included)
    # Who each key is: its priority class, fair share and rate limits (router/cluster/tenancy.py).
    tenants: tuple[TenantSettings, ...] = ()
    priority_classes: tuple[str, ...] = DEFAULT_CLASSES  # highest first
    limit_share: float = 1.0  # this router's part of every tenant's rate limits (1 / the routers sharing them)
    # how long a tenant that stopped asking still has decode slots kept for it, and the span of its average
    # use (router/cluster/fair_share.py); 0: no slot shares, fair queuing's order alone
    tenant_share_window_s: float = 10.0
    internal_secret: str | None = field(default=None, repr=False)  # sent to prefill/decode servers; admin key
    launch_id: str | None = None  # the `pdserve launch` that started this router, reported in /health
    # Workers must report this launch in /health (None: any): the router's own launch, unless it serves
    # a multi-host cluster whose other hosts' servers other launches started (deploy/launcher.py).
    workers_launch_id: str | None = None
    tracing: TracingSettings = field(default_factory=TracingSettings)  # off unless an endpoint is set
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    response_store: ResponseStoreSettings = field(default_factory=ResponseStoreSettings)

    @property
    def listen_host(self) -> str:
        return self.bind_host or self.host
