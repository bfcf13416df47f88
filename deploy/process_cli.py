"""`pdserve router|prefill|decode --config FILE`: one process of a cluster config.

The cluster YAML is read here, in deploy/, and each process's entry function
gets only its frozen settings: ``RouterSettings`` for router/cli.py,
``ServerSettings`` for deploy/role_server.py (either server, whose role can change in place). No
package below deploy/ reads the cluster config itself.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.role_file import RoleFile
    from server_common.settings import ServerSettings

LOG_LEVELS = ["debug", "info", "warning", "error"]


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "router",
        help="run the OpenAI-compatible router of a cluster config",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics, "
        "dispatching to the config's prefill and decode servers.",
    )
    p.add_argument("--config", required=True, help="cluster YAML file (see configs/)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log this and above (default info)")
    p.add_argument(
        "--response-store",
        metavar="FILE",
        help="the SQLite file /v1/responses stores responses in, unless the config's "
        "router.response_store.path names one (or its url a PostgreSQL database); `pdserve launch` "
        "gives its run folder's responses.sqlite (default: in memory, gone with the router)",
    )
    p.add_argument(
        "--replica",
        type=int,
        metavar="K",
        help="which of the config's router.replicas this router is (0 first): it serves on that replica's port "
        "and takes that replica's part of each worker's in-flight limit (`pdserve launch` passes it; without "
        "it a router takes router.port and the part every replica gets)",
    )
    _add_launch_id(p)
    # A router of a multi-host cluster (``launch --only``) reports its launch but accepts workers of any.
    p.add_argument("--any-worker-launch", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run_router)

    _add_server_parser(
        subparsers,
        "prefill",
        run_prefill,
        "run one prefill server of a cluster config",
        "Run the prefill instance NAME of a cluster config: engine thread in prefill mode, KV "
        "sender and the HTTP control plane (/prefill, /abort, /health, /metrics).",
    )
    _add_server_parser(
        subparsers,
        "decode",
        run_decode,
        "run one decode (or colocated) server of a cluster config",
        "Run the decode or colocated instance NAME of a cluster config: engine thread, KV "
        "receiver and the HTTP control plane (/generate, /abort, /health, /metrics).",
    )


def _add_server_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    command: str,
    func: Callable[[argparse.Namespace], int],
    help: str,
    description: str,
) -> None:
    p = subparsers.add_parser(command, help=help, description=description)
    p.add_argument("--config", required=True, help="cluster YAML file (see configs/)")
    p.add_argument("--name", required=True, help="this instance's name in the config")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log this and above (default info)")
    p.add_argument(
        "--kv-cache-bytes",
        type=_positive_int,
        metavar="N",
        help="this server's KV cache in bytes (per rank), instead of the config's kv_cache_bytes; `pdserve launch` "
        "passes it where that is auto, having sized every server of the host together (deploy/kv_memory.py)",
    )
    _add_launch_id(p)
    # Where the server records its role; a restarted one starts in the role recorded (deploy/role_file.py).
    p.add_argument("--role-file", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=func)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_launch_id(parser: argparse.ArgumentParser) -> None:
    """``--launch-id``: the nonce ``pdserve launch`` gives every process it starts; servers report it
    in /health and the router accepts only workers that report its own (deploy/launcher.py)."""
    parser.add_argument("--launch-id", default=None, help=argparse.SUPPRESS)


def run_router(args: argparse.Namespace) -> int:
    from deploy.config import load_config
    from router.cli import run
    from server_common.run import setup_logging

    setup_logging(args.log_level, "router")
    cluster = load_config(args.config)
    settings = dataclasses.replace(
        cluster.router_settings(cluster.model_path(), args.response_store, args.replica),
        launch_id=args.launch_id,
        workers_launch_id=None if args.any_worker_launch else args.launch_id,
    )
    return run(settings, args.log_level)


def run_prefill(args: argparse.Namespace) -> int:
    from deploy.role_server import run

    return run(_confined(_server_settings(args, ("prefill",))), args.log_level, _role_file(args))


def run_decode(args: argparse.Namespace) -> int:
    from deploy.role_server import run

    return run(_confined(_server_settings(args, ("decode", "colocated"))), args.log_level, _role_file(args))


def _role_file(args: argparse.Namespace) -> RoleFile | None:
    """The server's role file (``pdserve launch`` names one in its run folder), or None."""
    from deploy.role_file import RoleFile

    return None if args.role_file is None else RoleFile(Path(args.role_file), args.name, args.launch_id)


def _server_settings(args: argparse.Namespace, expected_roles: tuple[str, ...]) -> ServerSettings:
    from deploy.config import ConfigError, load_config
    from server_common.run import setup_logging

    setup_logging(args.log_level, args.name)
    cluster = load_config(args.config)
    role = cluster.role_of(args.name)
    if role not in expected_roles:
        raise ConfigError(f"{args.config}: instance {args.name!r} is a {role} instance, not {'/'.join(expected_roles)}")
    settings = cluster.server_settings(args.name, cluster.model_path(), args.kv_cache_bytes)
    return dataclasses.replace(settings, launch_id=args.launch_id)


def _confined(settings: ServerSettings) -> ServerSettings:
    """``settings``, once a NIXL server's UCX is kept to the interface of its host: UCX reads
    ``UCX_NET_DEVICES`` when the agent starts and otherwise listens on every interface
    (transfer/netdev.py)."""
    if settings.transfer_backend == "nixl":
        from transfer.netdev import confine_ucx_to

        confine_ucx_to(settings.listen_host)
    return settings
