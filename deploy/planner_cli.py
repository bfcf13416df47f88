"""`pdserve planner --config FILE`: the planner in the loop (deploy/planner.py), as a process of its own.

Only the parser is built at import; the loop (deploy/planner_loop.py) is
imported when the command runs.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "planner",
        help="run the planner of a cluster config (its planner: section)",
        description="Every planner.interval_s, read the routers' token rates and SLO attainment, decide how many "
        "prefill and decode servers the load asks for and, with planner.mode act, switch one instance's role "
        "(a launched cluster) or run more or fewer of each role's instances (Kubernetes). Serves /health, "
        "/metrics and /decisions on planner.port. `pdserve launch` starts it when planner.mode is not off.",
    )
    p.add_argument("--config", required=True, help="cluster YAML file (see configs/)")
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log this and above"
    )
    p.add_argument("--launch-id", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deploy.config import load_config
    from deploy.planner_loop import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s planner %(levelname)s: %(message)s")
    cluster = load_config(args.config)
    if cluster.planner.mode == "off":
        print(f"pdserve planner: error: {args.config}: planner.mode is off", flush=True)
        return 2
    return serve(cluster, Path(args.config), args.launch_id)
