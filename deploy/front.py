"""The front of several routers under `pdserve launch`: one HAProxy process on ``router.port``.

With ``router.replicas`` N > 1 the launcher starts N full routers on
``router.replica_ports`` and HAProxy (the distribution's package ``haproxy``)
in front of them, with its config rendered here into the run folder:

- ``balance leastconn``: a router's connections are mostly long streams, so
  the one with the fewest open is the least loaded;
- a health check on each router's ``/health`` every second: a router that
  stops answering 200 (killed, draining, no decode server) leaves rotation
  after two failed checks and comes back after one good one; a connection
  refused on a dead router's port is retried once on another (``redispatch``);
- SSE-friendly: HAProxy forwards each chunk as it comes (nothing is
  buffered; ``option http-buffer-request`` is off), and ``timeout server`` /
  ``timeout tunnel`` are long (``STREAM_TIMEOUT_S``): the routers bound a
  stream themselves (``stream_stall_s``, ``max_tokens``);
- keep-alive on both sides, so a request reuses a connection to a router;
  ``maxconn`` per router is its ``max_connections_per_client``, since every
  request through the front comes from one address (excess waits in HAProxy's
  queue up to ``queue_timeout_s`` instead of being refused by the router);
- ``X-Forwarded-For`` carries the client's address.

On Kubernetes the router Service is the front (deploy/k8s.py); nothing here is rendered for it.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from deploy.config import ClusterConfig

HAPROXY_PACKAGE = "haproxy"  # the Debian (and Ubuntu, Fedora, Alpine) package
STREAM_TIMEOUT_S = 3600  # the longest a response stream may go without a byte through the front
CHECK_INTERVAL_MS = 1000
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin")  # where the package puts it, often not on a user's PATH
FRONT_NAME = "haproxy"  # the front's process name in cluster.json, restarts.json and its log


class FrontMissing(RuntimeError):
    pass


def haproxy_binary() -> str:
    """The haproxy executable; FrontMissing, naming the package, when it is not installed."""
    found = shutil.which("haproxy", path=os.pathsep.join([os.environ.get("PATH", os.defpath), *SBIN_DIRS]))
    if found is None:
        raise FrontMissing(
            f"router.replicas > 1 puts HAProxy in front of the routers, and haproxy is not installed: install "
            f"the distribution's package {HAPROXY_PACKAGE!r} (Debian/Ubuntu: apt-get install {HAPROXY_PACKAGE})"
        )
    return found


def _s(seconds: float) -> str:
    return f"{max(1, math.ceil(seconds * 1000))}ms"


def haproxy_config(cluster: ClusterConfig) -> str:
    """HAProxy's config for the cluster's routers (see the module docstring)."""
    r = cluster.router
    servers = [
        f"    server router-{k} {cluster.router_host}:{port} check maxconn {r.max_connections_per_client}"
        for k, port in enumerate(cluster.router_replica_ports)
    ]
    lines = [
        "# Rendered by `pdserve launch` (deploy/front.py): HAProxy in front of this cluster's routers.",
        "global",  # no maxconn: HAProxy derives it from the file-descriptor limit it finds
        "    log stdout format raw local0 notice",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option http-keep-alive",
        "    option forwardfor",
        "    option redispatch",
        "    retries 1",
        "    http-reuse safe",
        f"    timeout connect {_s(min(cluster.router.health_timeout_s, 5.0))}",
        f"    timeout http-request {_s(r.header_timeout_s)}",
        f"    timeout http-keep-alive {_s(r.client_keepalive_s)}",
        f"    timeout queue {_s(r.queue_timeout_s)}",
        f"    timeout client {STREAM_TIMEOUT_S}s",
        f"    timeout server {STREAM_TIMEOUT_S}s",
        f"    timeout tunnel {STREAM_TIMEOUT_S}s",
        "",
        "frontend pdserve",
        f"    bind {cluster.router_bind_host}:{r.port}",
        "    default_backend routers",
        "",
        "backend routers",
        "    balance leastconn",
        "    option httpchk GET /health",
        "    http-check expect status 200",
        f"    default-server inter {CHECK_INTERVAL_MS}ms fastinter {CHECK_INTERVAL_MS // 2}ms fall 2 rise 1",
        *servers,
    ]
    return "\n".join(lines) + "\n"


def write_haproxy_config(cluster: ClusterConfig, run_dir: Path) -> Path:
    path = run_dir / "haproxy.cfg"
    path.write_text(haproxy_config(cluster))
    return path
