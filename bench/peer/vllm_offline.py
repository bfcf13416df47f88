"""vLLM's own engine, offline, on one model folder: prefill and decode tok/s per batch, and its greedy tokens.

Run by ``python -m bench.micro.families --vllm`` with the interpreter of vLLM's venv (bench/peer/vllm.py),
so it imports nothing of pdserve:

    VENV/bin/python bench/peer/vllm_offline.py FOLDER PROMPTS.json --new-tokens 16 --rounds 3

``PROMPTS.json``: ``{"batch": [[token ids], ...], ...}``, one list of prompts per batch size. Measured
as the families bench measures pdserve's engine, float32, no prefix caching:

* prefill: ``batch`` prompts computed and one token sampled (``max_tokens=1``);
* decode: the same prompts with ``1 + new_tokens`` tokens, less the prefill's time, over the
  ``batch x new_tokens`` tokens after the first (vLLM's offline API gives no per-step time);

each the best of ``--rounds`` after one warm-up. Prints one ``ROW {json}`` line per batch size, with
the greedy tokens of its first prompt.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder")
    p.add_argument("prompts", help="a JSON file: batch size -> its prompts (token ids)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    with open(args.prompts) as f:
        batches = {int(k): v for k, v in json.load(f).items()}

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.folder,
        dtype="float32",
        max_model_len=args.max_model_len,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
    )
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    whole = SamplingParams(max_tokens=1 + args.new_tokens, temperature=0, ignore_eos=True)

    def best(prompts: list, sampling: SamplingParams) -> tuple[float, list]:
        llm.generate(prompts, sampling, use_tqdm=False)
        times, out = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            out = llm.generate(prompts, sampling, use_tqdm=False)
            times.append(time.perf_counter() - started)
        return min(times), out

    for batch, ids in sorted(batches.items()):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        prefill, _ = best(prompts, first)
        both, out = best(prompts, whole)
        row = {
            "batch": batch,
            "vllm_prefill_tok_s": round(batch * len(ids[0]) / prefill, 1),
            "vllm_decode_tok_s": round(batch * args.new_tokens / max(both - prefill, 1e-9), 1),
            "vllm_tokens": list(out[0].outputs[0].token_ids),
        }
        print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":  # vLLM's engine process is spawned: it imports this module again
    main()
