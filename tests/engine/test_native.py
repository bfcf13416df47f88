"""engine.native's kernels: built wherever the CPU can run them; the bfloat16 projection of a few rows
float32 arithmetic rounded once, the float32 one each row's exact projection where that is exact in
float32, the same for a row alone or with others, and what ``Linear`` uses for a few rows; the bfloat16 RMSNorm Hugging
Face's arithmetic to one bfloat16 step; decode attention over each row's context read in place
through its block table, as sdpa over that context (tests/engine/test_oracle.py: greedy tokens with it
and without it equal transformers); DecodeLayer, a whole layer for one decode row, bit for bit the
layer run op by op, in the cache it writes too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine, SamplingParams, native
from engine.attention import AttentionMetadata, DecodeGroup
from engine.loader import load_model
from engine.model import DecoderLayer, Linear, RMSNorm
from engine.runner import RoPE
from engine.tensor_parallel import Shard
from tests.support.cluster import REPO

CAN_RUN = native.unavailable() is None
needs_cpu = pytest.mark.skipif(not CAN_RUN, reason=f"native kernels cannot run here: {native.unavailable()}")


def test_the_kernels_build_wherever_the_cpu_can_run_them():
    if CAN_RUN:
        assert native.kernels() is not None, native.status()
        assert native.status() == "native CPU kernels: in use"
    else:
        assert native.kernels() is None and native.unavailable() in native.status()


def native_command(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m engine.native ARGS`` with ``env`` added to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "engine.native", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, **env},
    )


def test_turned_off_it_says_so_and_the_command_reports_it(monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    assert native.unavailable() == "PDSERVE_NATIVE=0"
    run = native_command("--require", PDSERVE_NATIVE="0")
    assert run.returncode == 1 and "not used (PDSERVE_NATIVE=0)" in run.stdout
    assert native_command("--help").returncode == 0


def test_the_build_folder_is_keyed_by_everything_the_build_depends_on(monkeypatch):
    # Two virtual environments of one torch version on one machine used to share a folder, and each
    # start rebuilt over the other's build; the same environment must keep finding its own.
    here = native.cache_dir()
    assert native.cache_dir() == here
    for name, value in [("executable", "/other/venv/bin/python"), ("version", sys.version + " other")]:
        with monkeypatch.context() as m:
            m.setattr(sys, name, value)
            assert native.cache_dir() != here, name
    with monkeypatch.context() as m:
        m.setattr(torch, "__file__", "/other/venv/lib/site-packages/torch/__init__.py")
        assert native.cache_dir() != here
    with monkeypatch.context() as m:
        m.setenv("CXX", "clang++")
        assert native.cache_dir() != here
    with monkeypatch.context() as m:
        m.setattr(native, "CFLAGS", [*native.CFLAGS, "-g"])
        assert native.cache_dir() != here


def test_the_cache_folder_is_the_one_named_and_an_empty_name_is_the_default(monkeypatch, tmp_path):
    # An empty PDSERVE_NATIVE_CACHE (a script's unset variable) once built into the working directory.
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path))
    assert native.cache_dir().parent == tmp_path
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", "")
    assert native.cache_dir().parent == Path("~/.cache/pdserve/native").expanduser()


@needs_cpu
def test_a_cache_folder_it_cannot_write_is_a_failed_build_and_torch_serves(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = native_command("--require", PDSERVE_NATIVE_CACHE=str(blocker / "native"))
    assert run.returncode == 1 and "not used (the build failed: " in run.stdout, run.stdout + run.stderr


def one_ulp_of(expected: torch.Tensor) -> torch.Tensor:
    """A bfloat16 value's spacing (8 bits of precision) at each of ``expected``'s magnitudes."""
    exponent = torch.floor(torch.log2(expected.float().abs().clamp_min(1e-30)))
    return torch.exp2(exponent - 7)


@needs_cpu
@pytest.mark.parametrize(
    ("inputs", "outputs", "bias"), [(576, 960, False), (40, 7, True), (1536, 576, True), (32, 4, False)]
)
def test_gemv_is_float32_arithmetic_rounded_once(inputs, outputs, bias):
    torch.manual_seed(inputs + outputs)
    x = torch.randn(1, inputs).to(torch.bfloat16)
    w = torch.randn(outputs, inputs).to(torch.bfloat16)
    b = torch.randn(outputs).to(torch.bfloat16) if bias else None
    got = native.kernels().gemv_bf16(x, w, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.shape == (1, outputs) and got.dtype == torch.bfloat16
    # float32 sums in another order than float64's: at most one bfloat16 step from the exact value's rounding
    assert ((got.double() - exact).abs() <= one_ulp_of(exact) + 1e-6).all()


@needs_cpu
@pytest.mark.parametrize("rows", [2, 3, 5])
def test_gemv_gives_each_of_several_rows_what_it_gives_that_row_alone(rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 200).to(torch.bfloat16)  # 200: the 32-value loads end in a tail
    w = torch.randn(70, 200).to(torch.bfloat16)  # 70: the last weight rows fewer than a pass's four
    b = torch.randn(70).to(torch.bfloat16)
    gemv = native.kernels().gemv_bf16
    assert torch.equal(gemv(x, w, b), torch.cat([gemv(x[m : m + 1], w, b) for m in range(rows)]))


@needs_cpu
def test_gemv_refuses_what_it_does_not_compute():
    gemv = native.kernels().gemv_bf16
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    for x in (torch.zeros(1, 1, 32, dtype=bf16), torch.zeros(1, 32), torch.zeros(1, 16, dtype=bf16)):
        with pytest.raises(RuntimeError, match="gemv_bf16"):
            gemv(x, w)


@needs_cpu
@pytest.mark.parametrize("bias", [False, True])
def test_linear_sends_a_few_bfloat16_rows_to_the_kernel_and_more_to_onednn(bias):
    torch.manual_seed(1)
    linear = Linear(96, 160, bias=bias).to(torch.bfloat16)
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    assert linear.few_rows is not None and linear.few_rows_max == 3
    x = torch.randn(6, 96).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 3):
            assert torch.equal(linear(x[:rows]), native.kernels().gemv_bf16(x[:rows], weight, b))
        assert torch.equal(linear(x), F.linear(x, weight, b))  # more rows: the packed copy


def input_major(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] as Linear keeps a float32 weight: a transposed view of an input-major tensor."""
    return w.t().contiguous().t()


@needs_cpu
@pytest.mark.parametrize(
    ("inputs", "outputs"), [(576, 960), (1536, 576), (40, 7), (19, 37), (64, 200), (5, 16), (33, 9000)]
)
def test_float32_gemv_gives_each_row_its_projection_exactly_where_float32_holds_it(inputs, outputs):
    # Small integers: every partial sum is exact in float32, so any wrong row, column, tail or bias shows.
    # outputs 200 and 37 end in a unit of fewer than 16 columns; 960 and 200 leave a thread a short last pass;
    # 9000 (562.5 units) spans several of a thread's 4096-column blocks, its last one short and masked.
    g = torch.Generator().manual_seed(inputs * outputs)
    w = input_major(torch.randint(-4, 5, (outputs, inputs), generator=g).float())
    b = torch.randint(-50, 51, (outputs,), generator=g).float()
    x = torch.randint(-4, 5, (8, inputs), generator=g).float()
    gemv = native.kernels().gemv_f32
    for rows in range(1, 9):
        for bias in (None, b):
            exact = x[:rows].double() @ w.double().T + (0 if bias is None else bias.double())
            got = gemv(x[:rows], w, bias)
            assert got.shape == (rows, outputs) and got.dtype == torch.float32
            assert torch.equal(got.double(), exact), (rows, bias is None)


@needs_cpu
def test_float32_gemv_rounds_like_float32_and_a_row_s_result_is_the_same_alone_with_others_and_on_one_thread():
    torch.manual_seed(3)
    # 9000 columns: several 4096-column blocks a thread (a wide projection such as a 262k-token lm_head)
    w, b, x = input_major(torch.randn(9000, 300)), torch.randn(9000), torch.randn(8, 300)
    gemv = native.kernels().gemv_f32
    every = gemv(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    # float32 sums of 300 products: far inside 300 float32 roundings of the products' magnitudes
    bound = 300 * 2.0**-24 * ((x.double().abs() @ w.double().abs().T) + b.double().abs())
    assert ((every.double() - exact).abs() <= bound).all()
    for rows in range(1, 8):
        assert torch.equal(gemv(x[:rows], w, b), every[:rows])
        assert torch.equal(gemv(x[rows : rows + 1], w, b), every[rows : rows + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gemv(x, w, b), every)
    finally:
        torch.set_num_threads(threads)


@needs_cpu
def test_float32_gemv_refuses_what_it_does_not_compute():
    gemv = native.kernels().gemv_f32
    w = input_major(torch.zeros(8, 32))
    for x in (torch.zeros(9, 32), torch.zeros(0, 32), torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 16)):
        with pytest.raises(RuntimeError, match="gemv_f32"):
            gemv(x, w)
    with pytest.raises(RuntimeError, match="transpose"):
        gemv(torch.zeros(1, 32), torch.zeros(8, 32))  # [out, in] rows: not the layout it reads
    with pytest.raises(RuntimeError, match="bias"):
        gemv(torch.zeros(1, 32), w, torch.zeros(7))


@needs_cpu
@pytest.mark.parametrize("copies", ["1", "2"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_sends_up_to_eight_float32_rows_to_the_kernel_and_more_to_onednn(bias, copies, monkeypatch):
    monkeypatch.setenv("PDSERVE_F32_WEIGHT_COPIES", copies)  # oneDNN over a packed copy (2) or the weight (1)
    torch.manual_seed(2)
    linear = Linear(96, 160, bias=bias).float()
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    assert linear.few_rows is not None and linear.few_rows_max == 8
    assert torch.equal(linear.weight, weight) and linear.weight.t().is_contiguous()
    x = torch.randn(12, 96)
    with torch.inference_mode():
        for rows in (1, 5, 8):
            assert torch.equal(linear(x[:rows]), native.kernels().gemv_f32(x[:rows], linear.weight, b))
        assert linear(x[:0]).shape == (0, 160)  # no rows (an empty step's slice): not the kernel's
        assert linear.packed is not None and linear.packed.is_mkldnn == (copies == "2")
        if copies == "1":
            assert linear.packed.data_ptr() == linear.weight.data_ptr()  # the input-major weight itself
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.packed, b, "none", [], "")
        assert torch.equal(linear(x), onednn)  # more rows: oneDNN
        assert torch.allclose(linear(x), F.linear(x, weight, b), atol=1e-5)


@needs_cpu
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_is_hugging_face_arithmetic_to_one_bfloat16_step(rows):
    torch.manual_seed(rows)
    x = (torch.randn(rows, 576) * 5).to(torch.bfloat16)
    w = torch.randn(576).to(torch.bfloat16)
    h = x.float()
    expected = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = native.kernels().rms_norm_bf16(x, w, 1e-5)
    # Its float32 sum of squares runs in another order than torch's: the odd value lands one step away.
    assert (got != expected).float().mean() < 1e-3
    assert ((got.double() - expected.double()).abs() <= 2 * one_ulp_of(expected)).all()
    heads = x.view(rows, 9, 64)  # per-head norms (q_norm, k_norm) take [tokens, heads, dim], a slice too
    assert native.kernels().rms_norm_bf16(heads[:, 1:], w[:64], 1e-5).shape == (rows, 8, 64)


@needs_cpu
@pytest.mark.parametrize(("rows", "dim", "scale"), [(1, 576, 1.0), (1, 576, 300.0), (9, 64, 0.01), (3, 1000, 1.0)])
def test_float32_rms_norm_is_torch_s_bit_for_bit(rows, dim, scale):
    torch.manual_seed(rows * dim)
    for _ in range(20):
        x = torch.randn(rows, dim) * scale
        w = 1 + 0.2 * torch.randn(dim)
        assert torch.equal(native.kernels().rms_norm_f32(x, w, 1e-6), w * F.rms_norm(x, (dim,), eps=1e-6))
    heads = torch.randn(2, 9, 64)[:, 1:]  # per-head norms take a slice of [tokens, heads, dim]
    w = torch.randn(64)
    assert torch.equal(native.kernels().rms_norm_f32(heads, w, 1e-5), w * F.rms_norm(heads, (64,), eps=1e-5))


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("dim", [64, 20])  # 20: each key and value ends in a partial 16-lane load
def test_decode_attention_equals_sdpa_over_each_row_s_own_context(dtype, hnd, dim):
    torch.manual_seed(3)
    q_heads, kv_heads, block_size, blocks = 9, 3, 16, 40
    lengths = [1, 16, 17, 150]  # scores go 16 tokens at a time: one, a whole 16, 16 and one, nine and a part
    tables = [[5], [7, 0], [2, 9], list(range(10, 20))]
    width = max(len(t) for t in tables)
    keys = [torch.randn(n, kv_heads, dim).to(dtype) for n in lengths]
    values = [torch.randn(n, kv_heads, dim).to(dtype) for n in lengths]
    cache_k = torch.randn(blocks, block_size, kv_heads, dim).to(dtype)
    cache_v = torch.randn(blocks, block_size, kv_heads, dim).to(dtype)
    for n, table, k, v in zip(lengths, tables, keys, values):
        for t in range(n):
            cache_k[table[t // block_size], t % block_size] = k[t]
            cache_v[table[t // block_size], t % block_size] = v[t]
    if hnd:
        cache_k, cache_v = cache_k.transpose(1, 2).contiguous(), cache_v.transpose(1, 2).contiguous()
    q = torch.randn(len(lengths), q_heads, dim).to(dtype)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    got = native.kernels().decode_attention(q, cache_k, cache_v, table, torch.tensor(lengths), 0.125, hnd)
    for row, (k, v) in enumerate(zip(keys, values)):
        query = q[row].view(kv_heads, q_heads // kv_heads, dim).float()
        expected = F.scaled_dot_product_attention(
            query, k.transpose(0, 1).float(), v.transpose(0, 1).float(), scale=0.125
        )
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[row].float(), expected.reshape(q_heads, dim), rtol=tolerance, atol=tolerance)


@needs_cpu
def test_decode_attention_refuses_a_length_past_its_table_or_a_block_outside_the_cache():
    cache = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="length outside its block table"):
        native.kernels().decode_attention(q, cache, cache, torch.tensor([[1, 2]]), torch.tensor([33]), 0.125, False)
    for block_id in (4, -1):  # the cache holds blocks 0..3; the padding past a row's length is not read
        with pytest.raises(RuntimeError, match="block id outside the cache"):
            native.kernels().decode_attention(
                q, cache, cache, torch.tensor([[1, block_id, 99]]), torch.tensor([20]), 0.125, False
            )
    native.kernels().decode_attention(q, cache, cache, torch.tensor([[1, 3, 99]]), torch.tensor([20]), 0.125, False)
    with pytest.raises(RuntimeError, match="multiple of the cache's kv heads"):
        native.kernels().decode_attention(
            torch.zeros(1, 3, 64),
            torch.zeros(4, 16, 2, 64),
            torch.zeros(4, 16, 2, 64),
            torch.tensor([[1]]),
            torch.tensor([3]),
            0.125,
            False,
        )


# Sizes off every kernel's stride: hidden 80 (the projections' 32-value loads end in a tail), head_dim 20,
# intermediate 100 (SiLU's vectorised loop ends in a scalar tail in both dtypes).
LAYER = SimpleNamespace(
    hidden_size=80, num_attention_heads=4, num_key_value_heads=2, intermediate_size=100, rms_norm_eps=1e-6
)
HEAD_DIM, BLOCK, BLOCKS = 20, 16, 6


def packed_layer(dtype: torch.dtype, qk_norm: bool, bias: bool) -> DecoderLayer:
    """A layer with random weights, laid out for the CPU as CausalLM.pack_for_cpu does it."""
    torch.manual_seed(7)
    cfg = SimpleNamespace(**vars(LAYER), mlp_bias=bias)
    layer = DecoderLayer(cfg, HEAD_DIM, qk_norm, bias, Shard(), None)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    layer = layer.to(dtype)
    for module in layer.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()
        elif isinstance(module, RMSNorm):
            module.use_cpu_kernel()
    layer.use_cpu_kernel()
    return layer


def decode_layer_of(layer: DecoderLayer, few_rows_max: int, qkv=None, gate_up=None):
    """engine.native's DecodeLayer over ``layer``'s weights (no packed copies), with ``qkv`` or ``gate_up``
    in place of the layer's own."""
    attn, mlp = layer.self_attn, layer.mlp
    return native.kernels().DecodeLayer(
        layer.input_layernorm.weight,
        attn.qkv_proj.weight if qkv is None else qkv,
        None,
        None,
        None,
        attn.o_proj.weight,
        layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.weight if gate_up is None else gate_up,
        None,
        mlp.down_proj.weight,
        None,
        heads=4,
        kv_heads=2,
        head_dim=HEAD_DIM,
        eps=1e-6,
        scale=HEAD_DIM**-0.5,
        packed=[],
        packed_min_rows=2,
        few_rows_max=few_rows_max,
    )


# (context length, block table) of up to nine decode rows, each writing its own slot
ROWS = [
    (40, (3, 0, 5)),
    (17, (1, 2)),
    (5, (4,)),
    (35, (3, 0, 2)),
    (2, (1,)),
    (16, (5,)),
    (9, (0,)),
    (30, (1, 3)),
    (12, (4,)),
]


def decodes(hnd: bool, rows: int) -> tuple[AttentionMetadata, list[int]]:
    """A step of ``rows`` decode rows (one group, as the runner makes it for the native kernel), and their slots."""
    lengths = [n for n, _ in ROWS[:rows]]
    tables = [list(t) + [0] * (3 - len(t)) for _, t in ROWS[:rows]]
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for n, t in zip(lengths, tables)]
    group = DecodeGroup(0, rows, torch.tensor(tables), torch.tensor(lengths), None)
    meta = AttentionMetadata(torch.tensor(slots), rows, [group], [], hnd, native.kernel("decode_attention"))
    return meta, slots


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
@pytest.mark.parametrize("rows", [1, 3, 6, 9])  # 9: more than either dtype's gemv serves (the packed matmul)
def test_decode_layer_is_the_layer_op_by_op_bit_for_bit(dtype, qk_norm, bias, hnd, rows):
    layer = packed_layer(dtype, qk_norm, bias)
    assert layer.fused is not None
    rope = RoPE(SimpleNamespace(rope_theta=10000.0), HEAD_DIM, 64, dtype, torch.device("cpu"))
    meta, slots = decodes(hnd, rows)
    positions = torch.tensor([n - 1 for n, _ in ROWS[:rows]])
    cos, sin_signed = rope.cos[0, positions].unsqueeze(1), rope.sin_signed[0, positions].unsqueeze(1)
    inner = (2, BLOCK) if hnd else (BLOCK, 2)
    cache = torch.randn(2, BLOCKS, *inner, HEAD_DIM).to(dtype)
    x = torch.randn(rows, LAYER.hidden_size).to(dtype)
    with torch.inference_mode():
        fused_cache = cache.clone()
        fused = layer(x, cos, sin_signed, fused_cache, meta)
        fused_layer, layer.fused = layer.fused, None
        ops_cache = cache.clone()
        ops = layer(x, cos, sin_signed, ops_cache, meta)
        layer.fused = fused_layer
    assert torch.isfinite(fused).all() and not torch.equal(fused, x)
    assert torch.equal(fused, ops)
    assert torch.equal(fused_cache, ops_cache)
    written = sorted(map(tuple, (fused_cache != cache).nonzero()[:, 1:3].unique(dim=0).tolist()))
    at = [(slot // BLOCK, slot % BLOCK) for slot in slots]  # k and v of each row at its slot, nowhere else
    assert written == sorted({(b, h) for b, _ in at for h in (0, 1)} if hnd else at)


@needs_cpu
def test_decode_layer_refuses_a_slot_or_block_outside_the_cache_and_wrong_weights():
    layer = packed_layer(torch.bfloat16, False, False)
    x = torch.zeros(1, LAYER.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, 1, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(2, BLOCKS, BLOCK, 2, HEAD_DIM, dtype=torch.bfloat16)
    row = decodes(False, 1)[0].decodes[0]
    for slot in (BLOCKS * BLOCK, -1):
        with pytest.raises(RuntimeError, match="slot outside the cache"):
            layer.fused(x, cos, sin, cache, torch.tensor([slot]), row.block_table, row.lengths, False)
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        layer.fused(x, cos, sin, cache, torch.tensor([3]), torch.tensor([[BLOCKS, 0, 5]]), row.lengths, False)
    with pytest.raises(RuntimeError, match="must be contiguous rows"):
        layer.fused(x.float(), cos, sin, cache, torch.tensor([3]), row.block_table, row.lengths, False)
    attn = layer.self_attn
    with pytest.raises(RuntimeError, match="gate_up must be"):
        decode_layer_of(layer, 3, gate_up=attn.qkv_proj.weight)  # not [2 x intermediate, hidden]


@needs_cpu
def test_a_float32_decode_layer_with_the_native_gemv_needs_input_major_weights_and_at_most_eight_rows():
    layer = packed_layer(torch.float32, False, False)
    qkv = layer.self_attn.qkv_proj.weight.detach()

    def build(few_rows_max: int, qkv: torch.Tensor):
        return decode_layer_of(layer, few_rows_max, qkv=qkv)

    build(8, qkv)  # as use_cpu_kernel builds it
    with pytest.raises(RuntimeError, match="qkv must be .* input-major"):
        build(8, qkv.contiguous())
    build(0, qkv.contiguous())  # no rows to gemv_f32: torch's linear takes any layout
    with pytest.raises(RuntimeError, match="few_rows_max must be 0 to 8"):
        build(9, qkv)


@needs_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_decoding_runs_each_layer_as_one_call_with_the_same_tokens(tiny_model, dtype):
    prompts = [[(17 * i + 5 * s) % 500 + 3 for i in range(20 + 7 * s)] for s in range(3)]
    runs = []
    for fused in (True, False):
        engine = LLMEngine(EngineConfig(model=tiny_model, dtype=dtype, num_blocks=64, block_size=4, num_threads=1))
        layers = engine.runner.model.layers
        assert all(layer.fused is not None for layer in layers)
        rows_seen: list[int] = []
        for layer in layers:
            layer.fused = counted(layer.fused, rows_seen) if fused else None
        sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        one = engine.generate(prompts[:1], sampling)[0].token_ids  # one decode row a step
        three = [r.token_ids for r in engine.generate(prompts, sampling)]  # three decode rows a step
        runs.append((one, three, engine.cache.kv.clone()))
        if fused:
            assert {1, 3} <= set(rows_seen)
    (fused_one, fused_three, fused_kv), (ops_one, ops_three, ops_kv) = runs
    assert len(fused_one) == 24 and fused_one == ops_one and fused_three == ops_three
    assert torch.equal(fused_kv, ops_kv)


def counted(fused, rows_seen: list[int]):
    def call(x, *args):
        rows_seen.append(x.shape[0])
        return fused(x, *args)

    return call


LOGITS_CAN_RUN = native.unavailable(native.LOGITS_NEEDS) is None
needs_logits = pytest.mark.skipif(
    not LOGITS_CAN_RUN, reason=f"the logits kernel cannot run here: {native.unavailable(native.LOGITS_NEEDS)}"
)


def test_the_logits_kernel_builds_wherever_the_cpu_can_run_it():
    if LOGITS_CAN_RUN:
        assert native.logits_kernels() is not None, native.logits_status()
        assert native.logits_status() == "native logits kernel: in use"
    else:
        assert native.logits_kernels() is None


@needs_logits
def test_float32_logits_round_like_float32_and_a_row_s_are_the_same_alone_with_others_and_on_one_thread():
    torch.manual_seed(4)
    # 1003 rows (not a multiple of any pass's 1, 2, 4 or 8), 300 inputs (a tail of 4 after 8-value loads)
    w, x = torch.randn(1003, 300), torch.randn(8, 300)
    logits = native.kernel("logits_f32")
    every = logits(x, w)
    exact = x.double() @ w.double().T
    bound = 300 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert every.shape == (8, 1003) and ((every.double() - exact).abs() <= bound).all()
    small = torch.randint(-4, 5, (8, 300)).float(), torch.randint(-50, 51, (1003, 300)).float()
    assert torch.equal(logits(*small).double(), small[0].double() @ small[1].double().T)  # exact where float32 is
    for rows in range(1, 8):
        assert torch.equal(logits(x[:rows], w), every[:rows])
        assert torch.equal(logits(x[rows : rows + 1], w), every[rows : rows + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(logits(x, w), every)
    finally:
        torch.set_num_threads(threads)


@needs_logits
def test_float32_logits_refuse_what_they_do_not_compute():
    logits = native.kernel("logits_f32")
    for x in (torch.zeros(9, 32), torch.zeros(0, 32), torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 16)):
        with pytest.raises(RuntimeError, match="logits_f32"):
            logits(x, torch.zeros(8, 32))
    with pytest.raises(RuntimeError, match="contiguous"):
        logits(torch.zeros(1, 32), torch.zeros(32, 8).t())  # an input-major weight: not the rows it reads


@needs_logits
def test_a_few_rows_of_a_float32_tied_lm_head_read_the_embedding_itself(tiny_model):
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))  # tied embeddings; packed on load
    head, embedding = model.lm_head, model.embed_tokens.weight
    if native.kernel("gemv_f32") is not None:  # the input-major copy serves a few rows there
        assert head.rows_kernel is None
        return
    assert head.rows_kernel is not None and head.rows is not None
    assert head.rows.data_ptr() == embedding.data_ptr() and embedding.is_contiguous()
    x = torch.randn(12, embedding.shape[1])
    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 9, 12):  # the kernel from two to eight rows, the input-major copy otherwise
            torch.testing.assert_close(head(x[:rows]), F.linear(x[:rows], embedding), rtol=1e-5, atol=1e-5)


def built_logits_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A cache of its own holding a copy of the built logits kernel (built once; install.sh does it), without
    any lock: (the cache, the kernel's folder in it)."""
    assert native.logits_kernels() is not None, native.logits_status()
    built = native.cache_dir(native.LOGITS_SOURCE, native.LOGITS_CFLAGS)
    cache = tmp_path / "native"
    shutil.copytree(built, cache / built.name, ignore=shutil.ignore_patterns("lock", "pdserve-build.lock"))
    return cache, cache / built.name


@needs_logits
def test_a_lock_left_by_a_build_that_was_killed_does_not_hold_up_the_next_process(tmp_path):
    # torch's build lock is a file only its maker removes: a process killed while it built left one, and
    # every later server on the host then waited for it forever before it could load the model.
    cache, folder = built_logits_copy(tmp_path)
    (folder / "lock").write_text("")  # what the killed build left
    code = "from engine import native; print(native.logits_status())"
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PDSERVE_NATIVE_CACHE": str(cache)},
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout == "native logits kernel: in use\n", run.stdout + run.stderr
    assert f"removing {folder / 'lock'}, left by a build that did not finish" in run.stderr
    assert not (folder / "lock").exists()


@needs_logits
def test_a_second_process_waits_for_a_build_under_way_and_says_so(tmp_path):
    import fcntl

    cache, folder = built_logits_copy(tmp_path)
    code = "from engine import native; print(native.logits_status(), flush=True)"
    with open(folder / "pdserve-build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build under way in this process
        child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PDSERVE_NATIVE_CACHE": str(cache)},
        )
        try:
            assert child.stderr is not None
            line = child.stderr.readline()  # it says it waits, and waits: it has printed nothing else
            assert line == f"pdserve: waiting for another process's build of logits.cpp in {folder}\n"
            assert child.poll() is None
        except BaseException:
            child.kill()
            child.wait()
            raise
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and out == "native logits kernel: in use\n", out + err
