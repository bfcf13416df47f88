"""engine.native's kernels: built wherever the CPU can run them; the one-row bfloat16 projection
float32 arithmetic rounded once, and what ``Linear`` uses for one row; the bfloat16 RMSNorm Hugging
Face's arithmetic to one bfloat16 step; decode attention over each row's context read in place
through its block table, as sdpa over that context (tests/engine/test_oracle.py: greedy tokens with it
and without it equal transformers)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import native
from engine.model import Linear
from tests.serving.cluster import REPO

CAN_RUN = native.unavailable() is None
needs_cpu = pytest.mark.skipif(not CAN_RUN, reason=f"native kernels cannot run here: {native.unavailable()}")


def test_the_kernels_build_wherever_the_cpu_can_run_them():
    if CAN_RUN:
        assert native.kernels() is not None, native.status()
        assert native.status() == "native CPU kernels: in use"
    else:
        assert native.kernels() is None and native.unavailable() in native.status()


def test_turned_off_it_says_so_and_the_command_reports_it(monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    assert native.unavailable() == "PDSERVE_NATIVE=0"
    run = subprocess.run(
        [sys.executable, "-m", "engine.native", "--require"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PDSERVE_NATIVE": "0"},
    )
    assert run.returncode == 1 and "not used (PDSERVE_NATIVE=0)" in run.stdout
    assert (
        subprocess.run([sys.executable, "-m", "engine.native", "--help"], cwd=REPO, capture_output=True).returncode == 0
    )


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
def test_gemv_refuses_what_it_does_not_compute():
    gemv = native.kernels().gemv_bf16
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    for x in (torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(1, 32), torch.zeros(1, 16, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="gemv_bf16"):
            gemv(x, w)


@needs_cpu
@pytest.mark.parametrize("bias", [False, True])
def test_linear_sends_one_bfloat16_row_to_the_kernel_and_more_to_onednn(bias):
    torch.manual_seed(1)
    linear = Linear(96, 160, bias=bias).to(torch.bfloat16)
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    assert linear.one_row is not None
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear(x[:1]), native.kernels().gemv_bf16(x[:1], weight, b))
        assert torch.equal(linear(x), F.linear(x, weight, b))  # two rows and more: the packed copy
    float32 = Linear(96, 160).float()
    float32.pack_for_cpu()
    assert float32.one_row is None


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hnd", [False, True])
def test_decode_attention_equals_sdpa_over_each_row_s_own_context(dtype, hnd):
    torch.manual_seed(3)
    q_heads, kv_heads, dim, block_size, blocks = 9, 3, 64, 16, 40
    lengths = [1, 16, 17, 150]
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
