"""The `pdserve` command line: one entry point, one subcommand per job.

Each package owns its subcommands through an ``add_parser(subparsers)``
function; this module only wires them together, so that ``pdserve --help``
lists everything and every subcommand has its own ``--help``.

Only argument parsing happens at import: the subcommand modules import torch,
transformers or uvicorn inside the function that runs the command, so
``pdserve --help`` and a config error answer in a fraction of a second
(tests/cluster/test_first_minutes.py checks that torch stays out).
"""

from __future__ import annotations

import argparse
import os
import sys

from bench import cli as bench_cli
from deploy import launch_cli, model_cli, planner_cli, process_cli, render_cli
from deploy.version import version


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """``command``: the command about to run, if known (see ``bench.cli.add_parser``)."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode-disaggregated LLM serving with an OpenAI-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    model_cli.add_parser(subparsers)
    launch_cli.add_parser(subparsers)
    render_cli.add_parser(subparsers)
    process_cli.add_parsers(subparsers)
    planner_cli.add_parser(subparsers)
    bench_cli.add_parser(subparsers, command)
    return parser


def _one_line(exc: Exception) -> str:
    """An error as one line; a pydantic validation error (SamplingParams' bounds) as "field: problem"."""
    from pydantic import ValidationError  # loaded already when one was raised

    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))
    args = parser.parse_args(argv)
    if not sys.stderr.isatty():  # in a log file a progress bar is one endless line of redraws
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"pdserve {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
