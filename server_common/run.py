"""Starting a server process: config -> settings -> engine -> uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cluster YAML file (see configs/)")
    parser.add_argument("--name", required=True, help="this instance's name in the config")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if level != "debug":  # one line per health check and per request is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)


def load_server_settings(args: argparse.Namespace, expected_roles: tuple[str, ...]):
    from deploy.config import ConfigError, load_config

    cluster = load_config(args.config)
    role = cluster.role_of(args.name)
    if role not in expected_roles:
        raise ConfigError(f"{args.config}: instance {args.name!r} is a {role} instance, not {'/'.join(expected_roles)}")
    return cluster.server_settings(args.name, cluster.model_path())


def serve(app, host: str, port: int, log_level: str) -> None:
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                timeout_graceful_shutdown=3)
