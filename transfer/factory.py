"""Backends by their config name: ``make_backend`` imports the one asked for.

The interface (``transfer.backend``) knows no backend and every backend
imports only the interface; this module, above both, is the one place that
names them.
"""

from __future__ import annotations

from transfer.backend import Backend, TransferError

BACKENDS = ("nixl", "zmq", "inproc")


def make_backend(kind: str, name: str, **options) -> Backend:
    """Build a backend by its config name. Options per kind:
    nixl: ucx_tls, ucx_net_devices; zmq: endpoint (receiver bind address),
    host; inproc: hub (an InprocHub shared by both sides)."""
    if kind == "nixl":
        try:
            from transfer.nixl_backend import NixlBackend
        except ImportError as exc:
            raise TransferError(
                f"transfer backend 'nixl' needs the nixl package ({exc}); install nixl==1.5.1 "
                f"or set the transfer backend to 'zmq'"
            ) from exc
        return NixlBackend(name, **options)
    if kind == "zmq":
        from transfer.zmq_backend import ZmqBackend

        return ZmqBackend(name, **options)
    if kind == "inproc":
        from transfer.inproc import InprocBackend

        return InprocBackend(name, **options)
    raise ValueError(f"transfer backend {kind!r} is not one of {BACKENDS}")
