"""Each model family's engine beside transformers on the same folder, and the KV it moves in 1P1D.

    python -m bench.micro.families [--real] [--families tiny,tiny-moe,tiny-swa,tiny-mla] \\
        [--batch 1,8] [--prompt-len 32] [--new-tokens 16] [--threads 1] [--kv-prompt-len 4096] \\
        [--model-cache DIR] [--json FILE]

For every family (a built-in model, built into ``--model-cache`` if missing;
with ``--real`` also gemma3-270m, smollm2 and qwen2.5-coder-0.5b where already
built there) and batch size, in one process on ``--threads`` torch threads,
float32:

* prefill tok/s: ``batch`` prompts of ``--prompt-len`` tokens, computed and
  one token sampled (the engine's ``generate`` with ``max_tokens=1``;
  transformers' forward over the unpadded ``[batch, prompt_len]`` batch);
* decode tok/s: ``--new-tokens`` more tokens per prompt, only the decode
  steps timed, after the prompts' own step (the engine's ``step`` once every
  prompt has its first token; transformers' forward of one token per row
  over its past key values, greedy, EOS ignored);
* ratio: the engine's tok/s over transformers'.

Each timing is the best of ``--rounds`` after one warm-up. KV columns come
from the engine's cache geometry, not a run: bytes of one token's K and V
over every layer, and what a prefill server moves for a prompt of
``--kv-prompt-len`` tokens in 1P1D (a sliding-window layer sends only the
prompt's last ``window - 1`` tokens: engine/kv_cache.py ``layer_tokens_sent``),
per request and per prompt token. A short run by default (tiny models,
seconds each).

``wide``, ``wide-moe``, ``wide-swa`` and ``wide-mla`` are the tiny
families' shapes with heads of 64 values (``wide-mla``: DeepSeek-V3's latent
sizes, 512 + 64), random and deterministic, built by this bench into
``--model-cache``/bench-wide: the width vLLM's CPU attention takes
(``python -m bench.peer.families`` sets vLLM beside the engine on them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

FAMILIES = ("tiny", "tiny-moe", "tiny-swa", "tiny-mla")
WIDE = ("wide", "wide-moe", "wide-swa", "wide-mla")
REAL = ("gemma3-270m", "smollm2", "qwen2.5-coder-0.5b")


def wide_spec(family: str):
    """The ``wide-`` form of a tiny family: its built-in spec with heads of 64 values (engine/make_model.py)."""
    import dataclasses

    from engine.make_model import TINY_MLA, TINY_MOE, TINY_SWA, TinySpec

    wide = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512}
    if family == "wide":
        return TinySpec(arch="qwen3", **wide)
    if family == "wide-moe":
        return dataclasses.replace(TINY_MOE, moe_intermediate=128, **wide)
    if family == "wide-swa":
        return dataclasses.replace(TINY_SWA, **wide)
    if family == "wide-mla":
        latent = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
        return dataclasses.replace(
            TINY_MLA, hidden=256, heads=4, intermediate=512, moe_intermediate=128, q_lora_rank=64, **latent
        )
    raise ValueError(f"unknown family {family!r}: the wide ones are {', '.join(WIDE)}")


def wide_folder(family: str, model_cache: str) -> Path:
    """The ``wide-`` family's folder under ``model_cache``/bench-wide, built there first if missing."""
    from engine.make_model import make_tiny

    folder = Path(model_cache).expanduser() / "bench-wide" / family
    if not (folder / "model.safetensors").is_file():
        make_tiny(folder, wide_spec(family))
    return folder


def family_folder(family: str, model_cache: str) -> Path:
    """A family's folder: this bench's ``wide-`` ones (built here), else a built-in model (or a folder)."""
    from engine.models import resolve_model

    return wide_folder(family, model_cache) if family in WIDE else resolve_model(family, model_cache)


def kv_bytes(engine, prompt_len: int) -> dict[str, int]:
    """KV bytes of the engine's cache geometry: a token over every layer, and what 1P1D moves for a prompt."""
    from engine.kv_cache import layer_tokens_sent

    per_layer_token = engine.cache.bytes_per_token // engine.cache.num_layers
    moved = layer_tokens_sent(engine.layer_windows, prompt_len) * per_layer_token
    return {
        "kv_bytes_per_token": engine.cache.bytes_per_token,
        "kv_prompt_len": prompt_len,
        "kv_bytes_moved_per_request": moved,
        "kv_bytes_moved_per_token": moved // prompt_len,
    }


def best(fn: Callable[[], object], rounds: int) -> float:
    """Seconds of the fastest of ``rounds`` calls, after one warm-up call."""

    def timed() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return best_of(timed, rounds)


def best_of(timed: Callable[[], float], rounds: int) -> float:
    """The smallest of ``rounds`` times that ``timed`` measured itself, after one warm-up call."""
    timed()
    return min(timed() for _ in range(rounds))


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts of ordinary token ids (the lowest few, often special, left out)."""
    return [[(7 * i + 31 * b) % (vocab - 10) + 5 for i in range(length)] for b in range(batch)]


def measure(folder: str, batches: list[int], args: argparse.Namespace) -> list[dict]:
    """One row per batch size: both sides' tok/s and their ratios, and the engine's KV bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine import EngineConfig, LLMEngine

    torch.set_num_threads(args.threads)
    # No prefix caching: every call computes its prompts, as transformers does.
    config = EngineConfig(
        model=folder, num_threads=args.threads, num_blocks=1024, max_num_seqs=64, prefix_caching=False
    )
    engine = LLMEngine(config)
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    try:
        kv = kv_bytes(engine, args.kv_prompt_len)
        return [{**measure_batch(engine, hf, batch, args), **kv} for batch in batches]
    finally:
        engine.close()


def measure_batch(engine, hf, batch: int, args: argparse.Namespace) -> dict:
    import torch

    from engine import SamplingParams

    ps = prompts(batch, args.prompt_len, engine.hf_config.vocab_size)
    ids, new = torch.tensor(ps), args.new_tokens
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    e_prefill = best(lambda: engine.generate(ps, first), args.rounds)
    e_decode = best_of(lambda: engine_decode_s(engine, ps, new), args.rounds)
    with torch.no_grad():
        h_prefill = best(lambda: hf(ids), args.rounds)
        h_decode = best_of(lambda: hf_decode_s(hf, ids, new), args.rounds)
    row: dict = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": new}
    if getattr(args, "greedy_tokens", False):  # the engine's greedy tokens for the first prompt (bench.peer)
        greedy = SamplingParams(max_tokens=1 + new, temperature=0, ignore_eos=True)
        row["engine_tokens"] = list(engine.generate([ps[0]], greedy)[0].token_ids)
    for side, prefill, decode in (("engine", e_prefill, e_decode), ("hf", h_prefill, h_decode)):
        row[f"{side}_prefill_tok_s"] = round(batch * args.prompt_len / prefill, 1)
        row[f"{side}_decode_tok_s"] = round(batch * new / decode, 1)
    for kind in ("prefill", "decode"):
        row[f"{kind}_ratio"] = round(row[f"engine_{kind}_tok_s"] / row[f"hf_{kind}_tok_s"], 2)
    return row


def engine_decode_s(engine, ps: list[list[int]], new: int) -> float:
    """Seconds of the engine's steps after every prompt has its first token, until each has ``new`` more."""
    from engine import SamplingParams

    sampling = SamplingParams(max_tokens=1 + new, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(ps):
        engine.add_request(f"decode-{i}", prompt, sampling)
    waiting_first = set(range(len(ps)))
    while waiting_first:
        for out in engine.step():
            waiting_first.discard(int(out.request_id.removeprefix("decode-")))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def hf_decode_s(hf, ids, new: int) -> float:
    """Seconds of transformers' ``new`` one-token forwards per row over its past key values, greedy."""
    out = hf(ids, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(new):
        out = hf(token, past_key_values=past, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - started


def table(rows: list[dict]) -> str:
    cols = [
        ("family", "family"),
        ("batch", "batch"),
        ("engine_prefill_tok_s", "prefill tok/s"),
        ("hf_prefill_tok_s", "hf prefill"),
        ("prefill_ratio", "ratio"),
        ("engine_decode_tok_s", "decode tok/s"),
        ("hf_decode_tok_s", "hf decode"),
        ("decode_ratio", "ratio"),
        ("kv_bytes_per_token", "KV B/token"),
        ("kv_bytes_moved_per_token", "moved B/token"),
        ("kv_bytes_moved_per_request", "moved B/request"),
    ]
    lines = ["| " + " | ".join(title for _, title in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(row[key]) for key, _ in cols) + " |" for row in rows]
    return "\n".join(lines)


def arguments(p: argparse.ArgumentParser, default_families: tuple[str, ...] = FAMILIES) -> None:
    """The options of this bench (and of bench.peer.families, which adds vLLM's side)."""
    from engine.models import MODEL_CACHE

    p.add_argument(
        "--families",
        default=",".join(default_families),
        help=f"comma-separated: built-in models, or this bench's {', '.join(WIDE)}",
    )
    p.add_argument("--real", action="store_true", help=f"also the real models ({', '.join(REAL)}) where already built")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--rounds", type=int, default=3, help="timed calls per measurement (the best is kept)")
    p.add_argument("--kv-prompt-len", type=int, default=4096, help="the prompt the KV columns are for")
    p.add_argument("--model-cache", default=MODEL_CACHE, help="where built-in models are (built tiny ones too)")
    p.add_argument("--json", help="also write the rows to this file")


def families_of(args: argparse.Namespace) -> list[str]:
    """``--families``, and with ``--real`` the real models already built (the others named as left out)."""
    from engine.models import needs_build

    families = [f for f in args.families.split(",") if f]
    if args.real:
        families += [m for m in REAL if not needs_build(m, args.model_cache)]
        missing = [m for m in REAL if needs_build(m, args.model_cache)]
        if missing:
            print(f"not built in {args.model_cache}, left out: {', '.join(missing)}")
    return families


def write(rows: list[dict], text: str, args: argparse.Namespace) -> None:
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.micro.families", description=__doc__.split("\n")[0])
    arguments(p)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for family in families_of(args):
        folder = family_folder(family, args.model_cache)
        rows += [{"family": family, **row} for row in measure(str(folder), batches, args)]
    write(rows, table(rows), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
