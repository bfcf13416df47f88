"""``pdserve bench ...`` and ``pdserve plan``: registration only.

``serve``, ``compare``, ``router`` and ``plan`` take their arguments from their modules'
``add_arguments`` (light imports: no torch until a command runs).
``transfer`` and ``engine`` belong to other packages that parse their own
arguments in ``main(argv)``: everything after the command name, ``--help``
included, is handed to them, so ``pdserve --help`` does not import torch.
"""

from __future__ import annotations

import argparse


def _passthrough(sub, name: str, help_: str, description: str, main) -> None:
    # prefix_chars="+" makes this parser treat "--threads" as a plain word to pass along.
    parser = sub.add_parser(name, help=help_, description=description, add_help=False, prefix_chars="+")
    parser.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    parser.set_defaults(func=lambda args: main(args.argv))


def _run_transfer_bench(argv: list[str]) -> int:
    from bench.micro import transfer as transfer_bench

    return transfer_bench.main(argv)


def _run_engine_bench(argv: list[str]) -> int:
    from bench.micro import engine_bench

    return engine_bench.main(argv, prog="pdserve bench engine")


BENCH_HELP = "load tests and comparisons"
PLAN_HELP = "profile the engine and recommend an xPyD layout"


def add_parser(subparsers, command: str | None = None) -> None:
    """``command`` is the command being run, when known: for any other than ``bench`` and
    ``plan``, those two are listed by name and help only, which skips their argument
    definitions' imports (numpy, httpx: a quarter of a second of ``pdserve launch``)."""
    if command is not None and command not in ("bench", "plan"):
        subparsers.add_parser("bench", help=BENCH_HELP)
        subparsers.add_parser("plan", help=PLAN_HELP)
        return
    from bench.compare import compare
    from bench.load import serve
    from bench.micro import router_bench
    from bench.plan import kv as plan_kv
    from bench.plan import plan

    bench = subparsers.add_parser(
        "bench",
        help=BENCH_HELP,
        description="Benchmarks: load-test an endpoint, compare colocated vs disaggregated "
        "layouts, measure KV transfer, time the engine.",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    p = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible endpoint",
        description="Streams OpenAI-API requests to --url and reports TTFT, TPOT, ITL, E2E, "
        "throughput and goodput. Bounded by --num-requests or --duration.",
    )
    serve.add_arguments(p)
    p.set_defaults(func=serve.run)

    p = sub.add_parser(
        "compare",
        help="colocated vs xPyD on the same cores and workloads",
        description="Starts the colocated baseline and an xPyD layout with pdserve launch on the same "
        "cores, runs the same workloads against each, and writes a markdown report with "
        "plots, ratios and the planner's predictions next to the measurements.",
    )
    compare.add_arguments(p)
    p.set_defaults(func=compare.run)

    p = sub.add_parser(
        "router",
        help="what the router adds to a request, against stub servers",
        description="Starts stub prefill and decode servers (no model) behind the router and sends the same "
        "streamed load to the decode stub directly and through the router: added p50/p99 latency and "
        "time to first chunk at concurrency 1, requests/s at concurrency 64, router CPU per request.",
    )
    router_bench.add_arguments(p)
    p.set_defaults(func=router_bench.run)

    _passthrough(
        sub,
        "transfer",
        "KV transfer bandwidth and latency (bench.micro.transfer; --help for its options)",
        "Measures the KV transfer backends; all arguments go to bench.micro.transfer.",
        _run_transfer_bench,
    )
    _passthrough(
        sub,
        "engine",
        "offline engine throughput vs transformers (bench.micro.engine_bench)",
        "Times the engine without HTTP; all arguments go to bench.micro.engine_bench.",
        _run_engine_bench,
    )

    p = subparsers.add_parser(
        "plan",
        help=PLAN_HELP,
        description="Profiles the model on this machine (or reads a saved profile), simulates "
        "colocated and xPyD layouts for a workload and recommends x and y with "
        "predicted TTFT, TPOT and goodput.",
    )
    plan.add_arguments(p)
    p.set_defaults(func=plan.run)
    plan_sub = p.add_subparsers(dest="plan_command", metavar="[kv]")
    kv_parser = plan_sub.add_parser(
        "kv",
        help="KV cache bytes per token of a model, and for a sequence",
        description="Reads a model's config.json and prints the KV cache it keeps per token and for a sequence "
        "of --tokens tokens (full, grouped-query, latent and sliding-window attention).",
    )
    plan_kv.add_arguments(kv_parser)
    kv_parser.set_defaults(func=plan_kv.run)
