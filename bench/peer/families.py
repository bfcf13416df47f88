"""Each model family on pdserve's engine beside vLLM's CPU build (and transformers), on the same folder.

    python -m bench.peer.families [--families wide,wide-moe,wide-swa,wide-mla] [--real] \\
        [--batch 1,8] [--prompt-len 32] [--new-tokens 16] [--threads 1] [--rounds 3] \\
        [--vllm-cache DIR] [--vllm-timeout-s 900] [--json FILE]

bench.micro.families' rows (the engine and transformers in one process, on
``--threads`` torch threads, float32), with vLLM beside them: vLLM's CPU build
(bench/peer/vllm.py's venv, installed on first use) runs offline in its own
process (bench/peer/vllm_offline.py) on the first ``--threads`` cores, one
family at a time, measured the same way (its decode: the whole run less the
prefill, its offline API giving no per-step time). Each row adds vLLM's tok/s,
the engine's over vLLM's, and whether both engines' greedy tokens for the
first prompt are the same (a check of each other's arithmetic, neither one's
being the reference).

vLLM's CPU attention takes no head of 16 values, the tiny families' width,
so the default families are their ``wide-`` forms (bench.micro.families:
heads of 64 values). vLLM reads a copy of each folder whose ``config.json``
names the architecture (and, for DeepSeek-V3, the routing its weights are
for: ``noaux_tc``, sigmoid), which vLLM needs and a config made in code does
not say. A family vLLM refuses gets its reason in the row, not a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.load.cluster import cpu_list
from bench.micro.families import WIDE, arguments, families_of, family_folder, measure, prompts, write
from bench.peer.vllm import DEFAULT_CACHE, VllmError, install, server_env

# What vLLM's loader reads from config.json to pick the model class: by model_type.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def vllm_folder(folder: Path, into: Path) -> Path:
    """``folder`` as vLLM reads it: every file linked, and ``config.json`` copied naming its architecture
    (and, for DeepSeek-V3, the routing its weights are for: a correction bias added to sigmoid scores)."""
    into.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json" and not (into / f.name).exists():
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    kind = config.get("model_type")
    if not config.get("architectures") and kind in ARCHITECTURES:
        config["architectures"] = [ARCHITECTURES[kind]]
    if kind == "deepseek_v3":
        config.setdefault("topk_method", "noaux_tc")
        config.setdefault("scoring_func", "sigmoid")
    (into / "config.json").write_text(json.dumps(config, indent=1))
    return into


def vllm_rows(output: str) -> dict[int, dict]:
    """bench/peer/vllm_offline.py's ``ROW {json}`` lines, by batch size."""
    rows = [json.loads(line[4:]) for line in output.splitlines() if line.startswith("ROW ")]
    return {row["batch"]: row for row in rows}


def vllm_refusal(log: str) -> str:
    """The last error line of a failed vLLM run (its engine's reason, as it gave it)."""
    lines = [line.strip() for line in log.splitlines() if "Error" in line and ":" in line]
    return lines[-1][-300:] if lines else "vLLM ended without a result"


def measure_vllm(folder: Path, batches: list[int], args: argparse.Namespace, work: Path) -> dict[int, dict]:
    """vLLM's rows for ``folder`` by batch size, or each batch's ``vllm_refused`` reason."""
    try:
        env = install(Path(args.vllm_cache).expanduser())
    except VllmError as exc:
        return {b: {"vllm_refused": str(exc).splitlines()[0]} for b in batches}
    copy = vllm_folder(folder, work / folder.name)
    asked = work / f"{folder.name}-prompts.json"
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    asked.write_text(json.dumps({b: prompts(b, args.prompt_len, vocab) for b in batches}))
    script = Path(__file__).with_name("vllm_offline.py")
    # -P: the script's own folder (bench/peer, with its vllm.py) is not put first on sys.path
    command = [str(env.python), "-P", str(script), str(copy), str(asked)]
    command += ["--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds)]
    cores = cpu_list(None)[: args.threads]
    log = work / f"{folder.name}-vllm.log"
    print(f"vLLM on {folder.name} (log: {log})", flush=True)
    with open(log, "w") as sink:
        run = subprocess.Popen(
            command,
            env={**os.environ, **server_env(cores, 1.0, None)},
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            start_new_session=True,  # its engine processes with it, stopped together by group
        )
        try:
            out, _ = run.communicate(timeout=args.vllm_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
            return {b: {"vllm_refused": f"no result in {args.vllm_timeout_s:g} s"} for b in batches}
    with contextlib.suppress(ProcessLookupError):  # anything of its group left behind
        os.killpg(run.pid, signal.SIGKILL)
    rows = vllm_rows(out)
    if run.returncode != 0 or set(rows) != set(batches):
        reason = vllm_refusal(log.read_text(errors="replace"))
        return {b: {"vllm_refused": reason} for b in batches}
    return rows


def with_vllm(row: dict, vllm: dict) -> dict:
    """``row`` (the engine's and transformers') with vLLM's figures beside it: its tok/s, the engine's over
    them, and whether the two engines' greedy tokens are the same; or vLLM's reason for refusing."""
    if "vllm_refused" in vllm:
        return {**row, "vllm_refused": vllm["vllm_refused"]}
    out = {**row, "vllm_prefill_tok_s": vllm["vllm_prefill_tok_s"], "vllm_decode_tok_s": vllm["vllm_decode_tok_s"]}
    for kind in ("prefill", "decode"):
        out[f"vllm_{kind}_ratio"] = round(row[f"engine_{kind}_tok_s"] / vllm[f"vllm_{kind}_tok_s"], 2)
    out["same_tokens_as_vllm"] = row["engine_tokens"] == vllm["vllm_tokens"]
    return out


def vllm_table(rows: list[dict]) -> str:
    """The engine beside vLLM (and transformers): tok/s and the engine's ratio over vLLM's."""
    head = "| family | batch | prefill tok/s | vLLM prefill | ratio | hf prefill | decode tok/s | vLLM decode | ratio "
    head += "| hf decode | same greedy tokens |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        cells = [r["family"], r["batch"], r["engine_prefill_tok_s"]]
        if "vllm_refused" in r:
            why = f"vLLM refused: {r['vllm_refused']}"
            cells += [why, "", r["hf_prefill_tok_s"], r["engine_decode_tok_s"], "", "", r["hf_decode_tok_s"], ""]
        else:
            cells += [r["vllm_prefill_tok_s"], f"{r['vllm_prefill_ratio']}x", r["hf_prefill_tok_s"]]
            cells += [r["engine_decode_tok_s"], r["vllm_decode_tok_s"], f"{r['vllm_decode_ratio']}x"]
            cells += [r["hf_decode_tok_s"], "yes" if r["same_tokens_as_vllm"] else "no"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer.families", description=__doc__.split("\n")[0])
    arguments(p, WIDE)
    p.add_argument("--vllm-cache", default=DEFAULT_CACHE, help="where vLLM's venv is (or is installed)")
    p.add_argument("--vllm-timeout-s", type=float, default=900.0, help="at most this for vLLM on one family")
    args = p.parse_args(argv)
    args.greedy_tokens = True
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-families-") as work:
        for family in families_of(args):
            folder = family_folder(family, args.model_cache)
            ours = measure(str(folder), batches, args)
            theirs = measure_vllm(folder, batches, args, Path(work))
            rows += [{"family": family, **with_vllm(row, theirs[row["batch"]])} for row in ours]
    write(rows, vllm_table(rows), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
