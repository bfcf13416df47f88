"""The model's CPU fast paths compute what the plain formulas compute: RMSNorm and RoPE bit for bit,
packed projections to float32 rounding (bfloat16 bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.loader import load_model
from engine.model import Linear, RMSNorm, rotate
from engine.runner import RoPE


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_rmsnorm_equals_hugging_face_arithmetic(dtype, tokens):
    torch.manual_seed(tokens)
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (torch.randn(tokens, 64) * 5).to(dtype)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    with torch.inference_mode():
        assert torch.equal(norm(x), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_equals_rotate_half_form(dtype):
    class Config:
        rope_theta = 10000.0

    rope = RoPE(Config(), 64, 512, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 77, 511])
    cos = rope.cos[0, positions].unsqueeze(1)  # the one table of a model without per-layer RoPE
    sin_signed = rope.sin_signed[0, positions].unsqueeze(1)
    half = 32
    sin = torch.cat((-sin_signed[..., :half], sin_signed[..., half:]), dim=-1)  # the table before signing
    assert torch.equal(sin[..., :half], sin[..., half:])  # sin repeats over the two halves, as HF's does
    x = torch.randn(len(positions), 6, 64).to(dtype)
    assert torch.equal(rotate(x, cos, sin_signed), x * cos + rotate_half(x) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_plain_linear(dtype, bias):
    torch.manual_seed(0)
    linear = Linear(96, 160, bias=bias).to(dtype)
    weight = linear.weight.detach().clone()
    b = None if linear.bias is None else linear.bias.detach().clone()
    linear.pack_for_cpu()
    assert linear.packed is not None
    assert torch.equal(linear.weight, weight)  # same [out, in] values whatever the layout
    if dtype == torch.float32:
        assert linear.weight.t().is_contiguous()  # input-major, for the one-row matmul
    for rows in (1, 2, 8, 65):
        x = torch.randn(rows, 96).to(dtype)
        with torch.inference_mode():
            got, expected = linear(x), F.linear(x, weight, b)
        if dtype == torch.bfloat16:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packing_a_tied_model_keeps_the_embedding_rows(tiny_model):
    model, _ = load_model(tiny_model, torch.float32, torch.device("cpu"))  # tied embeddings; packed on load
    embedding = model.embed_tokens.weight
    assert embedding.is_contiguous()
    assert model.lm_head.weight is not embedding
    assert torch.equal(model.lm_head.weight, embedding)
    assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))
