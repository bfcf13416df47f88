"""Defaults every pdserve process shares, importable without the HTTP stack:
the settings modules and the cluster config loader need them, and a config
error must be reported without first importing fastapi."""

from __future__ import annotations

import ipaddress
from typing import Literal

LOOPBACK_HOST = "127.0.0.1"  # every process binds here unless the cluster config names another interface
DRAIN_TIMEOUT_S = 30.0  # on SIGTERM: the longest a process waits for its requests in flight
# A decode server told to drain or leave: its streams end with a "draining" error on which the router
# continues them on another decode server ("migrate"), or they finish where they are ("wait").
DrainMode = Literal["migrate", "wait"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") is this machine only; a host name counts as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
