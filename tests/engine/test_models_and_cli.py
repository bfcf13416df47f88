"""make-model determinism, the generate CLI, SmolLM2, CUDA and bfloat16."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.make_model import TinySpec, make_tiny
from tests.engine.oracle import hf_greedy

PDSERVE = [sys.executable, "-m", "deploy.cli"]


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_arguments_give_byte_identical_models(tmp_path):
    a = make_tiny(tmp_path / "a", TinySpec(seed=3))
    b = make_tiny(tmp_path / "b", TinySpec(seed=3))
    c = make_tiny(tmp_path / "c", TinySpec(seed=4))
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]


def test_tiny_tokenizer_round_trips_multibyte_text_and_has_a_chat_template(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "Café 東京 🙂 hello"
    assert tok.decode(tok(text).input_ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_servers_start_without_the_imports_they_do_not_need(tiny_model, tmp_path):
    """The router loads its tokenizer and context length without torch, and the engine builds its
    model in place without drawing random weights (which imports torch's compiler and sympy): both cost seconds of
    every start. The router's tokenizer is the one AutoTokenizer picks."""
    code = (
        "import sys, torch; from engine.loader import load_model; "
        "load_model(sys.argv[1], torch.float32, torch.device('cpu')); "
        "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)"
    )
    engine = subprocess.run([sys.executable, "-c", code, tiny_model], capture_output=True, text=True, check=True)
    code = (
        "import sys; from router.api.model import ServedModel; import router.app; "
        "m = ServedModel.load('tiny', sys.argv[1]); print('torch' in sys.modules, type(m.tokenizer).__name__, "
        "m.max_model_len)"
    )
    router = subprocess.run([sys.executable, "-c", code, tiny_model], capture_output=True, text=True, check=True)
    from transformers import AutoConfig, AutoTokenizer

    expected = AutoTokenizer.from_pretrained(tiny_model), AutoConfig.from_pretrained(tiny_model)
    assert engine.stdout.split() == ["False", "False"]
    assert router.stdout.split() == ["False", type(expected[0]).__name__, str(expected[1].max_position_embeddings)]


def test_generate_cli_prints_the_engine_tokens_as_json(tiny_model):
    proc = run_cli(
        "generate",
        "--model",
        tiny_model,
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "6",
        "--json",
        "--threads",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model)("The quick brown fox").input_ids
    assert result["token_ids"] == hf_greedy(tiny_model, prompt, 6)
    assert set(result) == {"token_ids", "text", "finish_reason"}


@pytest.mark.slow
def test_generate_builds_a_builtin_model_into_the_cache_once_and_uses_it(tiny_model, tmp_path):
    # The built-in name a cluster config accepts works here too, and is the same model.
    first = run_cli(
        "generate",
        "--model",
        "tiny",
        "--model-cache",
        str(tmp_path),
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "6",
        "--json",
        "--threads",
        "1",
    )
    assert first.returncode == 0, first.stderr
    assert "building model 'tiny'" in first.stderr and (tmp_path / "tiny" / "config.json").is_file()
    again = run_cli(
        "generate",
        "--model",
        "tiny",
        "--model-cache",
        str(tmp_path),
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "6",
        "--json",
        "--threads",
        "1",
    )
    assert again.returncode == 0 and "building" not in again.stderr
    direct = run_cli(
        "generate",
        "--model",
        tiny_model,
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "6",
        "--json",
        "--threads",
        "1",
    )
    assert json.loads(first.stdout) == json.loads(again.stdout) == json.loads(direct.stdout)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "does not exist"),
        (
            ["generate", "--model", "{tiny}", "--prompt", "x", "--max-tokens", "0"],
            "error: max_tokens: Input should be greater than or equal to 1\n",
        ),
        (["generate", "--model", "{tiny}", "--prompt", "x" * 5000], "context holds"),
        (["make-model", "tiny", "--out", "{tmp}/m", "--heads", "3", "--kv-heads", "2"], "multiple of kv_heads"),
    ],
)
def test_cli_errors_are_one_line_and_nonzero(tiny_model, tmp_path, args, message):
    args = [a.replace("{tiny}", tiny_model).replace("{tmp}", str(tmp_path)) for a in args]
    if "--prompt" in args and "x" * 5000 in args:
        args += ["--threads", "1"]
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_every_command_has_help():
    for args in (["--help"], ["make-model", "--help"], ["generate", "--help"]):
        proc = run_cli(*args)
        assert proc.returncode == 0 and "usage: pdserve" in proc.stdout


def test_bfloat16_engine_runs_and_agrees_on_the_first_tokens(tiny_model):
    prompt = [(13 * i) % 300 + 3 for i in range(30)]
    e = LLMEngine(EngineConfig(model=tiny_model, dtype="bfloat16", num_blocks=32, num_threads=1))
    assert e.cache.kv.dtype == torch.bfloat16
    tokens = e.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
    assert tokens[:2] == hf_greedy(tiny_model, prompt, 2)
    e.check_integrity()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_greedy_tokens_equal_transformers_on_cuda(tiny_model):
    prompts = [[(7 * i + n) % 400 + 3 for i in range(n)] for n in (1, 17, 100)]
    e = LLMEngine(EngineConfig(model=tiny_model, device="cuda", num_blocks=64))
    got = [r.token_ids for r in e.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    assert got == [hf_greedy(tiny_model, p, 8) for p in prompts]


@pytest.mark.slow
def test_smollm2_converted_from_its_wheel_says_paris(tmp_path_factory):
    from deploy.model_cli import chat_prompt_ids
    from engine.make_model import make_smollm2

    folder = make_smollm2(tmp_path_factory.mktemp("smollm2"))
    e = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, num_threads=2))
    prompt = chat_prompt_ids(e.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    result = e.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in result.text
    assert result.token_ids == hf_greedy(str(folder), prompt, 24)
