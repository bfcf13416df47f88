"""``pdserve bench ...`` and ``pdserve plan``: registration only.

Each command's module is imported when the command runs, so ``pdserve
--help`` does not pay for torch or matplotlib. Commands that need a part of
pdserve not yet on this branch say so instead of failing on an import.
"""

from __future__ import annotations

import argparse
import importlib

def _load(module: str):
    """The module, or None when it (or what it imports) is not on this branch.

    An ImportError here is the expected state of a branch that has not merged
    the part yet, not a failure, so it is turned into "not available".
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _lazy(module: str, waiting_for: str | None = None):
    """A ``func(args)`` that imports ``module`` and calls its ``run(args)``."""

    def func(args: argparse.Namespace) -> int:
        loaded = _load(module)
        if loaded is None:
            raise NotImplementedError(f"{module} is not available on this branch yet ({waiting_for})")
        return loaded.run(args)

    return func


def _add_arguments(parser: argparse.ArgumentParser, module: str) -> None:
    """Arguments from ``module.add_arguments`` when the module is available."""
    loaded = _load(module)
    if loaded is not None:
        loaded.add_arguments(parser)


def _run_engine_bench(args: argparse.Namespace) -> int:
    loaded = _load("bench.engine_bench")
    if loaded is None:
        raise NotImplementedError("bench.engine_bench is not available on this branch yet (lands with the engine)")
    return loaded.main(args.engine_argv)


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="load tests and comparisons",
        description="Benchmarks: load-test an endpoint, compare colocated vs disaggregated "
                    "layouts, measure KV transfer, time the engine.",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    serve = sub.add_parser(
        "serve", help="load-test an OpenAI-compatible endpoint",
        description="Streams OpenAI-API requests to --url and reports TTFT, TPOT, ITL, E2E, "
                    "throughput and goodput. Bounded by --num-requests or --duration.",
    )
    _add_arguments(serve, "bench.serve")
    serve.set_defaults(func=_lazy("bench.serve"))

    compare = sub.add_parser(
        "compare", help="colocated vs xPyD on the same cores and workload",
        description="Starts the colocated baseline and an xPyD layout from configs, runs the same "
                    "workloads against each, and writes a markdown report with plots, ratios and "
                    "the planner's predictions.",
    )
    _add_arguments(compare, "bench.compare")
    compare.set_defaults(func=_lazy("bench.compare", "needs the serving path and launcher"))

    transfer = sub.add_parser(
        "transfer", help="KV transfer bandwidth and latency",
        description="Measures the KV transfer backends (delegates to transfer.bench).",
    )
    _add_arguments(transfer, "transfer.bench")
    transfer.set_defaults(func=_lazy("transfer.bench", "lands with the transfer layer"))

    # bench.engine_bench parses its own arguments (``main(argv)``): everything
    # after ``engine``, --help included, is handed to it. prefix_chars="+"
    # makes this parser see "--threads" as a plain word to pass along.
    engine = sub.add_parser(
        "engine", help="offline engine throughput vs transformers (bench.engine_bench)",
        description="Times the engine without HTTP; all arguments go to bench.engine_bench.",
        add_help=False, prefix_chars="+",
    )
    engine.add_argument("engine_argv", nargs="*", help=argparse.SUPPRESS)
    engine.set_defaults(func=_run_engine_bench)

    plan = subparsers.add_parser(
        "plan", help="profile the engine and recommend an xPyD layout",
        description="Profiles the model on this machine (or reads a saved profile), simulates "
                    "colocated and xPyD layouts for a workload and recommends x and y with "
                    "predicted TTFT, TPOT and goodput.",
    )
    _add_arguments(plan, "bench.plan")
    plan.set_defaults(func=_lazy("bench.plan"))
