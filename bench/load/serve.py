"""``pdserve bench serve``: load-test any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from bench.load.loadgen import ENDPOINTS, HISTORIES, RESPONSES, LoadConfig, LoadResult, PreparedRequest, run_load
from bench.load.metrics import per_turn, summarize
from bench.load.prefix_workload import PrefixWorkload
from bench.load.prompts import PromptBuilder, load_tokenizer
from bench.load.report import (
    format_summary,
    format_turns,
    plot_latency_cdfs,
    plot_tpot_over_time,
    prompt_length_mismatches,
    write_json,
)
from bench.load.workload import LengthDist, RequestSpec, Workload, load_jsonl


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    target.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=ENDPOINTS,
        help="the API to load (default %(default)s; /v1/responses takes text prompts, and with --multi-turn "
        "continues each chat with previous_response_id: see --history)",
    )
    target.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    target.add_argument("--api-key", metavar="KEY", help="sent as a Bearer token")
    target.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="local tokenizer folder (default: the model folder /v1/models reports, if local)",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--concurrency", type=int, metavar="N", help="requests in flight (closed loop; a cap with --rate)"
    )
    load.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals per second ('inf': all at once)")
    load.add_argument("--num-requests", type=int, metavar="N", help="stop after this many requests")
    load.add_argument("--duration", type=float, metavar="S", help="stop starting requests after this many seconds")
    load.add_argument("--warmup", type=int, default=0, metavar="N", help="unmeasured requests sent first (default 0)")
    load.add_argument(
        "--request-timeout", type=float, default=300.0, metavar="S", help="seconds per request (default 300)"
    )
    work = p.add_argument_group("workload")
    work.add_argument(
        "--prompt-len",
        default="512",
        metavar="SPEC",
        help="N, uniform(LO,HI) or normal(MEAN,STD) tokens (default %(default)s)",
    )
    work.add_argument("--output-len", default="128", metavar="SPEC", help="same forms (default %(default)s)")
    work.add_argument(
        "--mix",
        action="append",
        metavar="W:PROMPT:OUTPUT",
        help="a request class (repeat for a mix, e.g. --mix 0.2:2048:16 --mix 0.8:64:128)",
    )
    work.add_argument("--dataset", metavar="FILE", help='JSONL of {"prompt": ..., "max_tokens": N}')
    work.add_argument(
        "--shared-prefix",
        type=int,
        metavar="TOKENS",
        help="every prompt starts with one of --prefix-groups shared prefixes of TOKENS tokens, "
        "then a question of --prompt-len tokens (bench/load/prefix_workload.py)",
    )
    work.add_argument(
        "--prefix-groups",
        type=int,
        default=1,
        metavar="G",
        help="distinct shared prefixes, request i takes prefix i %% G (default 1)",
    )
    work.add_argument(
        "--multi-turn",
        type=int,
        metavar="N",
        help="chats of N turns: each prompt is the chat's earlier questions and answers "
        "(--prompt-len and --output-len tokens each) and a new question",
    )
    work.add_argument(
        "--conversations",
        type=int,
        default=8,
        metavar="C",
        help="chats run side by side with --multi-turn (default 8; keep >= --concurrency)",
    )
    work.add_argument(
        "--history",
        choices=HISTORIES,
        help="with --multi-turn, what a turn sends of the turns before it: words, one prompt of synthetic "
        "questions and answers (the default on completions and chat); messages, every earlier question and "
        "the server's own answer (chat, responses); previous-response, only the new question with the "
        "previous turn's previous_response_id (responses, its default). With messages and previous-response "
        "a turn is sent once the one before it is answered",
    )
    work.add_argument(
        "--prompt-format",
        choices=["text", "tokens"],
        default="text",
        help="send verified exact-length text or token-id lists (default text)",
    )
    work.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (output may stop before max_tokens)",
    )
    work.add_argument("--extra-body", default="{}", metavar="JSON", help="extra fields merged into each body")
    work.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts and arrivals")
    out = p.add_argument_group("results")
    out.add_argument("--slo-ttft-ms", type=float, metavar="MS", help="TTFT SLO for goodput")
    out.add_argument("--slo-tpot-ms", type=float, metavar="MS", help="TPOT SLO for goodput")
    out.add_argument("--json", metavar="FILE", help="write summary and per-request results")
    out.add_argument("--plot-dir", metavar="DIR", help="write latency_cdf.png and tpot_over_time.png")
    out.add_argument(
        "--timeline",
        metavar="PNG",
        help="draw where each request's time went (router wait, reservation, prefill queue and "
        "compute, KV after compute, decode) from the servers' /debug/timeline",
    )
    out.add_argument(
        "--internal-secret-file",
        metavar="FILE",
        help="the cluster's internal secret, for --timeline when the cluster sets one",
    )
    out.add_argument(
        "--run-dir",
        metavar="DIR",
        help="for --timeline: the run folder of the cluster's `pdserve launch`, whose generated "
        "internal secret it reads (when no --internal-secret-file)",
    )
    out.add_argument("--label", default="run", help="name of this run in reports")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def discover_model(url: str, api_key: str | None = None) -> tuple[str, str | None]:
    """(model id, model folder) from ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        resp.raise_for_status()
        first = resp.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"cannot list models at {url}/v1/models ({exc}); pass --model") from None
    return first["id"], first.get("root")


def prefix_workload(args: argparse.Namespace) -> PrefixWorkload | None:
    """The --shared-prefix or --multi-turn workload, if asked for."""
    if args.shared_prefix is not None and args.multi_turn is not None:
        raise ValueError("--shared-prefix and --multi-turn are separate workloads: pick one")
    question, output = LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    if args.shared_prefix is not None:
        return PrefixWorkload(
            "shared_prefix", question, output, shared_tokens=args.shared_prefix, groups=args.prefix_groups
        )
    if args.multi_turn is not None:
        return PrefixWorkload("multi_turn", question, output, turns=args.multi_turn, conversations=args.conversations)
    return None


def history_of(args: argparse.Namespace, workload: object) -> str:
    """What a turn sends of the turns before it (``LoadConfig.history``): --history, or the endpoint's
    default; anything but words needs the multi-turn workload."""
    multi_turn = isinstance(workload, PrefixWorkload) and workload.kind == "multi_turn"
    if args.history is None:
        return "previous-response" if multi_turn and args.endpoint == RESPONSES else "words"
    if args.history != "words" and not multi_turn:
        raise ValueError(f"--history {args.history} continues chats: it needs --multi-turn")
    return args.history


def request_source(
    specs_or_workload: Workload | PrefixWorkload | list[RequestSpec],
    builder: PromptBuilder | None,
    prompt_format: str = "text",
    seed: int = 0,
    chained: bool = False,
) -> Callable[[int], PreparedRequest]:
    """``index -> PreparedRequest``; deterministic per index (warmup: negative).

    ``chained`` (a multi-turn workload): a turn's prompt is only its new question, and the request names
    its chat, whose earlier turns the load client sends as the server answered them (``LoadConfig.history``);
    a warmup request is one question of a chat of its own, alone.
    """

    def synthetic(index: int) -> PreparedRequest:
        rng = np.random.default_rng([seed, int(index < 0), abs(index)])
        spec = specs_or_workload.sample(index, rng)
        prompt = builder.build(spec.prompt_len, rng)
        body = prompt.text if prompt_format == "text" else prompt.token_ids
        return PreparedRequest(index, body, prompt.num_tokens, spec.output_len)

    def with_prefixes(index: int) -> PreparedRequest:
        segments, output_len = specs_or_workload.request(index, seed)
        chat = turn = None
        if specs_or_workload.kind == "multi_turn" and index >= 0:
            chat, turn = specs_or_workload.position(index)
        conversation = chat if chained else None
        if chained:
            segments = segments[-1:]  # the new question
        prompt = builder.from_segments(segments, seed)
        body = prompt.text if prompt_format == "text" else prompt.token_ids
        return PreparedRequest(index, body, prompt.num_tokens, output_len, turn, conversation)

    def from_file(index: int) -> PreparedRequest:
        spec = specs_or_workload[abs(index) % len(specs_or_workload)]
        return PreparedRequest(index, spec.prompt, spec.prompt_len, spec.output_len)

    if chained and not (isinstance(specs_or_workload, PrefixWorkload) and specs_or_workload.kind == "multi_turn"):
        raise ValueError("only a multi-turn workload continues chats")
    if isinstance(specs_or_workload, (Workload, PrefixWorkload)):
        if builder is None:
            raise ValueError("synthetic prompts need a tokenizer: pass --tokenizer DIR")
        return with_prefixes if isinstance(specs_or_workload, PrefixWorkload) else synthetic
    return from_file


def run_benchmark(config: LoadConfig, source, warmup: int = 0, progress: bool = True) -> LoadResult:
    """Runs the load with a tqdm bar (requests done); returns the records."""
    from tqdm import tqdm

    source(0)  # fail fast on a prompt the tokenizer cannot build
    bar = tqdm(total=config.num_requests, unit="req", disable=not progress, file=sys.stderr, desc="requests")

    failed = 0

    def on_done(rec) -> None:
        nonlocal failed
        bar.update(1)
        if not rec.ok:
            failed += 1
            bar.set_postfix(failed=failed)

    try:
        return asyncio.run(run_load(config, source, on_done=on_done, warmup=warmup))
    finally:
        bar.close()


def timeline_headers(args: argparse.Namespace) -> dict | None:
    """What --timeline sends: the internal secret (its file, or the one a launch wrote to --run-dir), else
    the API key (a cluster without a secret takes it on admin routes)."""
    secret = None
    if args.internal_secret_file:
        secret = Path(args.internal_secret_file).read_text().strip()
    elif args.run_dir:
        generated = Path(args.run_dir) / "internal_secret"
        if not generated.is_file():
            raise ValueError(
                f"--run-dir {args.run_dir} holds no internal_secret: the config names its own "
                "(pass --internal-secret-file)"
            )
        secret = generated.read_text().strip()
    secret = secret or args.api_key
    return {"Authorization": f"Bearer {secret}"} if secret else None


def draw_timeline(args: argparse.Namespace, records) -> str:
    """Fetch the processes' timelines, draw ``args.timeline``, and say which stage dominated."""
    from bench.load import timeline

    stages = timeline.join(
        timeline.fetch(args.url, timeline_headers(args)), [r.request_id for r in records if r.ok and r.request_id]
    )
    path = timeline.plot(stages, args.timeline, title=f"{args.label}: {len(stages)} requests")
    return f"{timeline.summary_line(stages)}\nplot: {path}"


def run(args: argparse.Namespace) -> int:
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not JSON ({exc})") from None
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    model, root = args.model, None
    if model is None:
        model, root = discover_model(args.url, args.api_key)
    elif args.tokenizer is None and not args.dataset:
        root = discover_model(args.url, args.api_key)[1]  # the tokenizer of the served model
    tokenizer_dir = args.tokenizer or (root if root and Path(root).is_dir() else None)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    prefixed = prefix_workload(args)
    if args.dataset:
        workload = load_jsonl(args.dataset, tokenizer)
    elif prefixed is not None:
        workload = prefixed
    else:
        workload = Workload.mix(args.mix) if args.mix else Workload.single(args.prompt_len, args.output_len)
    builder = PromptBuilder(tokenizer) if tokenizer is not None and not args.dataset else None
    history = history_of(args, workload)
    if args.endpoint == RESPONSES and args.prompt_format == "tokens":
        raise ValueError(f"{RESPONSES} takes text prompts: drop --prompt-format tokens")
    concurrency = args.concurrency
    if concurrency is None and args.rate is None:
        concurrency = 1
    config = LoadConfig(
        url=args.url,
        model=model,
        endpoint=args.endpoint,
        concurrency=concurrency,
        rate=args.rate,
        num_requests=args.num_requests,
        duration=args.duration,
        request_timeout=args.request_timeout,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=extra,
        api_key=args.api_key,
        seed=args.seed,
        history=history,
    )
    if args.timeline:  # a refusal now, not after the whole run
        from bench.load import timeline

        timeline.check_access(args.url, timeline_headers(args))
    source = request_source(workload, builder, args.prompt_format, args.seed, chained=history != "words")
    result = run_benchmark(config, source, args.warmup, args.progress)
    summary = summarize(result.records, result.duration_s, args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_summary(summary, f"Serving benchmark: {args.label}"))
    turns = per_turn(result.records)
    if turns:
        print(format_turns(turns))
    mismatches = prompt_length_mismatches(result.records)
    if mismatches:
        print(f"note: the server counted a different prompt length for {mismatches} request(s)")
    if args.json:
        described = asdict(config) | {
            "api_key": None,
            "workload": str(workload) if isinstance(workload, (Workload, PrefixWorkload)) else args.dataset,
            "prompt_format": args.prompt_format,
            "warmup": args.warmup,
            "label": args.label,
        }
        write_json(args.json, described, summary, result.records, {"per_turn": [t.to_json() for t in turns]})
        print(f"results: {args.json}")
    if args.plot_dir:  # the plots first: the timeline asks the cluster again, which may have gone
        runs = {args.label: result.records}
        for path in (
            plot_latency_cdfs(runs, Path(args.plot_dir) / "latency_cdf.png"),
            plot_tpot_over_time(runs, Path(args.plot_dir) / "tpot_over_time.png"),
        ):
            print(f"plot: {path}")
    if args.timeline:
        print(draw_timeline(args, result.records))
    return 0 if summary.completed else 1
