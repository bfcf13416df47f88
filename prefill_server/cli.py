"""`pdserve prefill`: one prefill server from a cluster config."""

from __future__ import annotations

import argparse

from server_common.run import add_server_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "prefill", help="run one prefill server of a cluster config",
        description="Run the prefill instance NAME of a cluster config: engine thread in prefill mode, KV "
                    "sender and the HTTP control plane (/prefill, /abort, /health, /metrics).",
    )
    add_server_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import LLMEngine
    from prefill_server.app import create_app
    from prefill_server.service import PrefillService
    from server_common.faults import FaultInjector
    from server_common.kv_adapter import sender_factory
    from server_common.run import load_server_settings, serve, setup_logging

    setup_logging(args.log_level, args.name)
    settings = load_server_settings(args, ("prefill",))
    engine = LLMEngine(settings.engine)
    faults = FaultInjector() if settings.fault_injection else None
    service = PrefillService(settings, engine, sender_factory(settings, engine, faults), faults)
    serve(create_app(service), settings.host, settings.port, args.log_level, service.drain, settings.drain_timeout_s)
    return 0
