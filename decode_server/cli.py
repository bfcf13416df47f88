"""`pdserve decode`: one decode (or colocated) server from a cluster config."""

from __future__ import annotations

import argparse

from server_common.run import add_server_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "decode", help="run one decode (or colocated) server of a cluster config",
        description="Run the decode or colocated instance NAME of a cluster config: engine thread, KV "
                    "receiver and the HTTP control plane (/generate, /abort, /health, /metrics).",
    )
    add_server_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from decode_server.app import create_app
    from decode_server.service import GenerationService
    from engine import LLMEngine
    from server_common.faults import FaultInjector
    from server_common.run import load_server_settings, serve, setup_logging

    setup_logging(args.log_level, args.name)
    settings = load_server_settings(args, ("decode", "colocated"))
    engine = LLMEngine(settings.engine)
    faults = FaultInjector() if settings.fault_injection else None
    make_receiver = None
    if settings.role == "decode":
        from server_common.kv_adapter import receiver_factory

        make_receiver = receiver_factory(settings, engine, faults)
    service = GenerationService(settings, engine, make_receiver, faults)
    serve(create_app(service), settings.host, settings.port, args.log_level, service.drain, settings.drain_timeout_s)
    return 0
