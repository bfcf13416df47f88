"""`pdserve launch CONFIG`: start a whole cluster on this machine."""

from __future__ import annotations

import argparse
import os


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "launch",
        help="start every process of a cluster config and the router",
        description="Start the prefill, decode (or colocated) servers and the router of CONFIG, wait until "
        "all are healthy, print the OpenAI endpoint and write RUN_DIR/cluster.json. Ctrl-C or "
        "SIGTERM (or any process dying) stops everything.",
    )
    p.add_argument("config", help="cluster YAML file, e.g. configs/1p1d.yaml")
    p.add_argument("--run-dir", default=None, help="folder for cluster.json and logs (default runs/<time>)")
    p.add_argument("--health-timeout", type=float, default=600.0, help="seconds to wait for each stage")
    p.add_argument(
        "--only",
        metavar="NAME[,NAME...]",
        help="start only these processes (instance names, 'router'): one host of a cluster whose "
        "other hosts run the rest from the same config",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from deploy.launch_scale import start_pool_scaler
    from deploy.launcher import launch

    os.environ.setdefault("TQDM_DISABLE", "1")  # the launcher prints plain progress lines instead (deploy/progress.py)
    only = {n.strip() for n in args.only.split(",") if n.strip()} if args.only else None
    return launch(
        args.config, args.run_dir, args.health_timeout, only, on_up=lambda c: start_pool_scaler(c, args.health_timeout)
    )
