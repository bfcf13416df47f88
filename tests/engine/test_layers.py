"""The model's fast paths compute what the plain formulas compute: RMSNorm and RoPE bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine.model import RMSNorm, rotate
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
    cos = rope.cos[positions].unsqueeze(1)
    sin_signed = rope.sin_signed[positions].unsqueeze(1)
    half = 32
    sin = torch.cat((-sin_signed[..., :half], sin_signed[..., half:]), dim=-1)  # the table before signing
    assert torch.equal(sin[..., :half], sin[..., half:])  # sin repeats over the two halves, as HF's does
    x = torch.randn(len(positions), 6, 64).to(dtype)
    assert torch.equal(rotate(x, cos, sin_signed), x * cos + rotate_half(x) * sin)
