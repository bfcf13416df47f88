"""`pdserve router`: the OpenAI-compatible router of a cluster config."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "router", help="run the OpenAI-compatible router of a cluster config",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics, "
                    "dispatching to the config's prefill and decode servers.",
    )
    p.add_argument("--config", required=True, help="cluster YAML file (see configs/)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deploy.config import load_config
    from router.app import create_app
    from server_common.run import serve, setup_logging

    setup_logging(args.log_level, "router")
    cluster = load_config(args.config)
    settings = cluster.router_settings(cluster.model_path())
    app = create_app(settings)
    serve(app, settings.host, settings.port, args.log_level, app.state.drain, settings.drain_timeout,
          http=app.state.connections.protocol_class())
    return 0
